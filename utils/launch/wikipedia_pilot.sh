#!/bin/bash
# The Wikipedia depth sweep (issue 47) on one lane, committing each run's record, and the report rewritten from the
# records, as they land. Resumable: run the same command again (in a later session too) and the run that was
# interrupted continues from its last save (every 500 updates); finished runs are reused from their records.
#
#   nohup bash utils/launch/wikipedia_pilot.sh > /work/wikipedia_pilot.log 2>&1 &     # the pilot: seed 1, L = 12, 24 first
#   nohup bash utils/launch/wikipedia_pilot.sh wikipedia > /work/wikipedia_sweep.log 2>&1 &   # the 3-seed sweep
#
# Run it with the project's Python environment active. To stop it, end this script and the depth_sweep.py under it
# first (kill PID), then the trainer (torchrun_main.py), which saves on SIGTERM before it exits; ended in the other
# order, the sweep would start its next run. A run killed without its save resumes from the one before (<= 500 updates).
# float32, eager: on a CPU without bf16 instructions --dtype mixed is about 3x slower (docs/study.md).
set -u
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's code, also in a worktree beside the installed one
BUDGET=${1:-wikipedia_pilot}
FLAGS=(--budget "$BUDGET" --dtype float32 --no-compile)
REPORT=docs/depth_sweep_wikipedia

commit_what_landed() {
    # Only this study's files, named one by one: other work in the checkout is never staged or committed.
    local landed
    mapfile -t landed < <(git status --porcelain -uall -- "$REPORT/runs" | cut -c4-)
    ((${#landed[@]})) || return 0
    python utils/depth_sweep.py "${FLAGS[@]}" --report_only > /dev/null
    mapfile -t landed < <(git status --porcelain -uall -- "$REPORT" | cut -c4-)
    git add -- "${landed[@]}" && git commit -q -m "Wikipedia depth sweep (--budget $BUDGET): $(
        printf '%s\n' "${landed[@]}" | sed -n 's|.*/runs/\(.*\)\.json\.gz$|\1|p' | paste -sd, -) landed; report rewritten" \
        -- "${landed[@]}" && echo "committed: ${landed[*]}"
}

python utils/depth_sweep.py "${FLAGS[@]}" --jobs 1 &
sweep=$!
while kill -0 "$sweep" 2>/dev/null; do
    sleep 300
    commit_what_landed
done
wait "$sweep"
status=$?
commit_what_landed
exit "$status"
