#!/usr/bin/env bash
# The one-command GPU check of a change: the paper's recipes compiled on one GPU, the eager 1B step, the bare steps,
# and an FSDP2 run stopped by SIGTERM and resumed. About 8 minutes on one H100.
#   bash utils/gpu/gpu_check.sh OUT_DIR [--stages recipes eager_1b bare_steps fsdp_resume] [--recipe_sizes 130m 1b]
# Writes OUT_DIR/gpu_check.md and OUT_DIR/gpu_check.json (small: bring these back, not the logs' runs). Exit code: 0
# every stage ran, 1 a stage failed, 2 no CUDA device (one line). Stages and targets: utils/gpu/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-python}" utils/gpu/gpu_check.py "$@"
