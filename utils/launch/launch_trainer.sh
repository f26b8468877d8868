#!/usr/bin/env bash
# Run a trainer command and exit with the trainer's own code (docs/training.md#exit-codes).
#   bash utils/launch/launch_trainer.sh torchrun --standalone --nproc_per_node 8 torchrun_main.py --flag value ...
#   bash utils/launch/launch_trainer.sh python torchrun_main.py --flag value ...
# torchrun reports any failed rank as exit code 1, so every rank writes its code into a fresh folder on its own node
# (TRAINER_EXIT_CODE_DIR) and this script reads them back once the launcher returns. On a multi-node run each node's
# script reads its own ranks' codes: no shared filesystem is needed. The highest code a rank reported wins; when no
# rank reported a non-zero code (a crash, a kill), the launcher's code is kept.
# SIGTERM, SIGUSR1 and SIGINT sent to this script alone (a `kill` of the job's shell, SLURM's --signal=B:USR1@600)
# are passed on to the launcher, which passes them to the ranks: SIGTERM and SIGUSR1 make the trainer finish the
# update, save and exit 5. torchrun is told to pass SIGUSR1 on too, and to give the ranks PET_SHUTDOWN_TIMEOUT seconds
# (600 unless set) to save before it kills them (its own default is 30).
set -uo pipefail
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
export PET_SHUTDOWN_TIMEOUT=${PET_SHUTDOWN_TIMEOUT:-600}
set -m  # the launcher in its own process group, with SIGINT not ignored, as a foreground command would have it
codes=$(mktemp -d)
trap 'rm -rf "$codes"' EXIT
TRAINER_EXIT_CODE_DIR=$codes "$@" &
launcher=$!
for signal_name in TERM USR1 INT; do
    # shellcheck disable=SC2064  # the signal's name is fixed now; the launcher's PID is known now
    trap "kill -$signal_name $launcher 2>/dev/null" "$signal_name"
done
# Polled rather than waited on: a trap runs between two sleeps, and the launcher's code is read once it is gone
# (a `wait` that a trapped signal ends returns the signal's number, not the launcher's code).
while kill -0 "$launcher" 2>/dev/null; do sleep 0.2; done
wait "$launcher"
launcher_code=$?
if [[ $launcher_code -eq 0 ]]; then exit 0; fi
trainer_code=$(cat "$codes"/rank* 2>/dev/null | sort -n | tail -n 1)
if [[ -n $trainer_code && $trainer_code -ne 0 ]]; then exit "$trainer_code"; fi
exit "$launcher_code"
