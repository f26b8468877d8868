"""The trainer's exit codes: the one list that torchrun_main.py, the run scripts' read-back
(utils/launch/launch_trainer.sh) and the table in docs/training.md#exit-codes follow (tests/test_exit_codes.py checks
the table against it)."""
import enum


class ExitCode(enum.IntEnum):
    FINISHED = 0
    ERROR = 1  # an unexpected error, with its traceback
    BAD_INPUT = 2  # one line naming the flag or file
    DIVERGED = 3  # results.json says why; nothing non-finite is saved
    NO_SPACE = 4  # the partial checkpoint removed, the last good one kept
    STOPPED = 5  # SIGTERM or SIGUSR1: the update finished, a checkpoint saved; the same command resumes it
    OUT_OF_MEMORY = 6  # the last good checkpoint is kept
