#!/usr/bin/env bash
# GPU smoke run: run_130m.sh (the paper's 130M recipe, pure bf16) for 50 update steps on the offline C4-layout
# folder with the T5-style tokenizer (utils/offline_fixtures.py), evaluating at steps 25 and 50 and saving at 50.
#   bash utils/gpu/gpu_smoke.sh [OUT_DIR] [extra torchrun_main.py flags]     (default OUT_DIR runs/gpu_smoke-<UTC time>)
# Exit code: as run_130m.sh (docs/training.md#exit-codes); 2 at once when no CUDA
# device is visible.
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-python}
if ! "$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_smoke.sh: error: no CUDA device is visible; this smoke run trains run_130m.sh on a GPU" >&2
    exit 2
fi
out=${1:-runs/gpu_smoke-$(date -u +%Y%m%d-%H%M%S)}
if [[ $# -gt 0 ]]; then shift; fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=${WANDB_MODE:-disabled}
"$python" utils/offline_fixtures.py c4 "$out/c4" >/dev/null
"$python" utils/offline_fixtures.py t5 "$out/t5" >/dev/null
exec bash run_130m.sh pre --dataset "$out/c4" --dataset_config en --tokenizer "$out/t5" \
    --num_training_steps 50 --warmup_steps 5 --eval_every 25 --save_every 50 --eval_tokens 50K --workers 2 \
    --save_dir "$out/run" "$@"
