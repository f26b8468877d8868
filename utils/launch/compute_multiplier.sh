#!/bin/bash
# Issue 79's runs, in the order in which each step answers something alone: what LNS is worth in compute, and does
# that grow with depth, at each arm's own rate and at twice the width. Every step resumes (finished runs are reused
# from their records, an interrupted one continues from its last save, every 400 updates), so a later session runs
# the same line again. Two lanes of one thread, float32, eager: the fastest layout on the CPU hosts measured
# (docs/benchmarks.md).
#
#   bash utils/launch/compute_multiplier.sh plan              # every step and its runs left, as JSON; trains nothing
#   nohup bash utils/launch/compute_multiplier.sh all > /work/multiplier.log 2>&1 &   # every step, in order
#   bash utils/launch/compute_multiplier.sh grid_2400         # one step
#
# Run it from a worktree frozen at a commit (git worktree add --detach ../sweep HEAD), so that edits to the checkout
# you work in never reach a running sweep, then copy the records (docs/*/runs/*.json.gz) back and rebuild with
# `python -m utils.study report all`. The steps:
#   grid_2400      the 2,400-update rate grid at L = 6 and 24, seed 1, both arms: 4e-3, 8e-3, 2e-3 again and 1e-3
#                  (its committed seed-1 checkpoints are gone, and the selection text needs them); each rate's
#                  records get their selection loss (utils/study/rate_choice.py)
#   wide_grid      hidden 128 at 2,400 updates: the small rate grid at seed 1, L = 12 and 6 (2e-3, 4e-3, 1e-3)
#   wide_2400      hidden 128 at 2,400 updates, L = 6, 12, 24, seeds 1-3, both arms, at WIDE_RATE (default 2e-3)
#   attnres_2400   Attention Residuals at 2,400 updates: its grid at seed 1, L = 6 and 24, then L = 6, 12, 24, seeds 1-3
#                  at ATTNRES_RATE (default 2e-3)
#   seeds_5_6      seeds 5 and 6 at every cell of the hidden-64 map at 2e-3 (seed 4 is kept aside)
#   budget_1200    1,200 updates, L = 6, 12, 24, 48, seeds 1-3, both arms, at 2e-3
#   wide_5000      hidden 128 at 5,000 updates, L = 6, 12, 24, seeds 1-3, both arms, at WIDE_RATE
set -u
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's code, also in a worktree beside the installed one
PLAN=()
[[ ${1:-} == plan ]] && PLAN=(--plan)
WIDE_RATE=${WIDE_RATE:-2e-3}
ATTNRES_RATE=${ATTNRES_RATE:-2e-3}

sweep() { python utils/depth_sweep.py --dtype float32 --no-compile "$@" "${PLAN[@]}"; }
folders_of() {  # a sweep's report and runs folders, as utils/study/cli.py resolves its flags
    python - "$@" <<'EOF'
import sys
from utils import depth_sweep
args = depth_sweep.parse_args([*sys.argv[1:], "--dtype", "float32", "--no-compile", "--plan"])
print(args.out)
print(args.runs_dir)
EOF
}
with_selection() {  # a sweep, then the selection loss of every finished run of SELECT_ARMS (default all) it holds
    sweep "$@" || return
    ((${#PLAN[@]})) && return
    local folders
    mapfile -t folders < <(folders_of "$@")
    python -m utils.study.rate_choice evaluate "${folders[0]}" --runs_dir "${folders[1]}" \
        ${SELECT_ARMS:+--arms $SELECT_ARMS}
}

grid_2400() {  # 4e-3 beat 2e-3 for both arms at L = 24 (seed 1), so 8e-3 comes before 2e-3 and 1e-3
    for rate in 4e-3 8e-3; do
        with_selection --budget wikipedia_2400 --lr "$rate" --depths 6 24 --first_depths 24 --seeds 1 || return
    done
    with_selection --budget wikipedia_2400 --lr 2e-3 --depths 6 24 --first_depths 24 --seeds 1 \
        --out docs/depth_sweep_wikipedia_2400_lr0.002_avx2 --runs_dir runs/depth_sweep_wikipedia_2400_lr0.002_avx2 \
        || return
    with_selection --budget wikipedia_2400 --lr 1e-3 --depths 6 24 --first_depths 24 --seeds 1
}
wide_grid() {
    for rate in 2e-3 4e-3 1e-3; do
        with_selection --budget wikipedia_2400_h128 --lr "$rate" --depths 6 12 --first_depths 12 --seeds 1 \
            --arms pre lns || return
    done
}
wide_2400() { sweep --budget wikipedia_2400_h128 --lr "$WIDE_RATE" --first_depths 24; }
attnres_2400() {  # its grid lands beside older Pre-LN and LNS records: only its own runs get a selection loss
    for rate in 2e-3 4e-3 1e-3; do
        SELECT_ARMS=attnres with_selection --budget wikipedia_2400_attnres --lr "$rate" --depths 6 24 --seeds 1 \
            --arms attnres || return
    done
    sweep --budget wikipedia_2400_attnres --lr "$ATTNRES_RATE" --arms attnres
}
seeds_5_6() {
    sweep --budget wikipedia_2400 --lr 2e-3 --seeds 5 6 --first_depths 24 || return
    sweep --budget wikipedia_5000 --lr 2e-3 --seeds 5 6 --first_depths 24 || return
    sweep --budget wikipedia --lr 2e-3 --depths 6 12 24 --seeds 5 6
}
budget_1200() { sweep --budget wikipedia_1200 --lr 2e-3 --first_depths 24 48; }
wide_5000() { sweep --budget wikipedia_5000_h128 --lr "$WIDE_RATE" --first_depths 24; }

STEPS=(grid_2400 wide_grid wide_2400 attnres_2400 seeds_5_6 budget_1200 wide_5000)
case ${1:-} in
    all | plan) for step in "${STEPS[@]}"; do echo "== $step"; "$step" || exit; done ;;
    *)
        if [[ " ${STEPS[*]} " == *" ${1:-} "* ]]; then "$1"; else
            echo "compute_multiplier.sh: unknown step '${1:-}'; one of: plan all ${STEPS[*]}" >&2
            exit 2
        fi ;;
esac
