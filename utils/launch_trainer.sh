#!/usr/bin/env bash
# Run a trainer command and exit with the trainer's own code: 0 finished, 1 error, 2 bad input, 3 diverged, 4 disk full.
#   bash utils/launch_trainer.sh torchrun --standalone --nproc_per_node 8 torchrun_main.py --flag value ...
#   bash utils/launch_trainer.sh python torchrun_main.py --flag value ...
# torchrun reports any failed rank as exit code 1, so every rank writes its code into a fresh folder on its own node
# (TRAINER_EXIT_CODE_DIR) and this script reads them back once the launcher returns. On a multi-node run each node's
# script reads its own ranks' codes: no shared filesystem is needed. The highest code a rank reported wins; when no
# rank reported a non-zero code (a crash, a kill), the launcher's code is kept.
set -uo pipefail
codes=$(mktemp -d)
trap 'rm -rf "$codes"' EXIT
TRAINER_EXIT_CODE_DIR=$codes "$@"
launcher_code=$?
if [[ $launcher_code -eq 0 ]]; then exit 0; fi
trainer_code=$(cat "$codes"/rank* 2>/dev/null | sort -n | tail -n 1)
if [[ -n $trainer_code && $trainer_code -ne 0 ]]; then exit "$trainer_code"; fi
exit "$launcher_code"
