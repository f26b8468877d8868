#!/usr/bin/env bash
# Paper recipe: LLaMA-130m on C4 (1 GPU), hyperparameters of the reference run script.
#   bash run_130m.sh NORM_TYPE [POST_NUM] [extra torchrun_main.py flags]      e.g. bash run_130m.sh LNS 3
# NPROC=<n> overrides the process count (default 1); TORCHRUN_ARGS replaces "--standalone" (multi-node).
# Exit code: 0 finished, 1 error, 2 bad input, 3 diverged, 4 disk full (read back from the ranks by
# utils/launch_trainer.sh), else torchrun's.
# Extra flags come last, so they override the values below (e.g. --dtype mixed, --fsdp, --continue_from DIR).
set -euo pipefail
cd "$(dirname "$0")"
norm_type=${1:?usage: bash run_130m.sh NORM_TYPE [POST_NUM] [extra torchrun_main.py flags]}
shift
post_num=""
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then post_num=$1; shift; fi
lr=1e-3
run_name="130m_${norm_type,,}"
if [[ ${norm_type,,} == post_pre && -n $post_num ]]; then run_name+="_post$post_num"; fi
run_name+="_lr$lr"
nproc=${NPROC:-1}

echo "run_130m.sh: norm_type=$norm_type post_num=${post_num:-none} lr=$lr processes=$nproc"
# shellcheck disable=SC2086  # TORCHRUN_ARGS is a list of flags
exec bash utils/launch_trainer.sh torchrun ${TORCHRUN_ARGS:---standalone} --nproc_per_node "$nproc" torchrun_main.py \
    --model_config configs/llama_130m.json \
    --norm_type "$norm_type" ${post_num:+--post_num "$post_num"} \
    --lr $lr \
    --batch_size 64 \
    --total_batch_size 512 \
    --num_training_steps 20000 \
    --warmup_steps 2000 \
    --weight_decay 0 \
    --dtype bfloat16 \
    --eval_every 1000 \
    --optimizer adam \
    --grad_clipping 0.0 \
    --max_length 256 \
    --run_name "$run_name" \
    "$@"
