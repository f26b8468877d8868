#!/usr/bin/env bash
# Paper recipe: LLaMA-350m on C4 (4 GPUs), hyperparameters of the reference run script.
#   bash run_350m.sh NORM_TYPE [POST_NUM] [extra torchrun_main.py flags]      e.g. bash run_350m.sh LNS 3
# The settings all four recipes share, the process count, torch.compile, signals and exit codes: utils/gpu/gpu_recipe.sh.
set -euo pipefail
cd "$(dirname "$0")"
script=run_350m.sh size=350m recipe_processes=4 lr=5e-4
recipe=(--model_config configs/llama_350m.json --lr $lr --batch_size 128 --num_training_steps 60000 --warmup_steps 6000)
source utils/gpu/gpu_recipe.sh
