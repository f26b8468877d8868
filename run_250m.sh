#!/usr/bin/env bash
# Paper recipe: LLaMA-250m on C4 (4 GPUs), hyperparameters of the reference run script.
#   bash run_250m.sh NORM_TYPE [POST_NUM] [extra torchrun_main.py flags]      e.g. bash run_250m.sh LNS 3
# The settings all four recipes share, the process count, torch.compile, signals and exit codes: utils/gpu/gpu_recipe.sh.
set -euo pipefail
cd "$(dirname "$0")"
script=run_250m.sh size=250m recipe_processes=4 lr=1e-3
recipe=(--model_config configs/llama_250m.json --lr $lr --batch_size 128 --num_training_steps 40000 --warmup_steps 4000)
source utils/gpu/gpu_recipe.sh
