#!/usr/bin/env bash
# Paper recipe: LLaMA-1b on C4 (8 GPUs), hyperparameters of the reference run script.
#   bash run_1b.sh NORM_TYPE [POST_NUM] [extra torchrun_main.py flags]      e.g. bash run_1b.sh LNS 3
# The settings all four recipes share, the process count, torch.compile, signals and exit codes: utils/gpu/gpu_recipe.sh.
set -euo pipefail
cd "$(dirname "$0")"
script=run_1b.sh size=1b recipe_processes=8 lr=5e-4
recipe=(--model_config configs/llama_1b.json --lr $lr --batch_size 32 --num_training_steps 100000 --warmup_steps 1000)
source utils/gpu/gpu_recipe.sh
