#!/usr/bin/env bash
# Paper recipe: LLaMA-130m on C4 (1 GPU), hyperparameters of the reference run script.
#   bash run_130m.sh NORM_TYPE [POST_NUM] [extra torchrun_main.py flags]      e.g. bash run_130m.sh LNS 3
# The settings all four recipes share, the process count, torch.compile, signals and exit codes: utils/gpu/gpu_recipe.sh.
set -euo pipefail
cd "$(dirname "$0")"
script=run_130m.sh size=130m recipe_processes=1 lr=1e-3
recipe=(--model_config configs/llama_130m.json --lr $lr --batch_size 64 --num_training_steps 20000 --warmup_steps 2000)
source utils/gpu/gpu_recipe.sh
