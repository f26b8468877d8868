#!/usr/bin/env bash
# A few-minute CPU pretraining run: the 24-layer tiny config on the embedded Austen corpus, offline.
#   bash run_tiny.sh NORM_TYPE [POST_NUM] [extra torchrun_main.py flags]      e.g. bash run_tiny.sh LNS
# Writes runs/tiny_<norm>-<time>/ (metrics.jsonl, results.json, loss_curve.png, norm_gains.png, model_<step>/)
# and prints the paths.
# PYTHON picks the interpreter (default: python); NPROC=2 runs two CPU processes through torchrun (gloo).
# One thread per process unless OMP_NUM_THREADS says otherwise: at this size a second thread buys nothing on an
# idle machine, and beside other work it is much slower (threads of one process wait on each other).
# Exit code: docs/training.md#exit-codes (read back from the ranks by utils/launch/launch_trainer.sh).
set -euo pipefail
cd "$(dirname "$0")"
script=run_tiny.sh
source utils/launch/run_arguments.sh
if [[ ${norm_type,,} == post_pre && -z $post_num ]]; then post_num=6; fi  # Mix-LN: a quarter of the 24 layers
run_name="tiny_${norm_type,,}"
if [[ ${norm_type,,} == post_pre ]]; then run_name+="_post$post_num"; fi
nproc=${NPROC:-1}
python=${PYTHON:-python}
export WANDB_MODE=${WANDB_MODE:-disabled}  # a smoke run: no wandb files unless asked for
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread unless told otherwise (see above)

if [[ $nproc -gt 1 ]]; then launcher=("$python" -m torch.distributed.run --standalone --nproc_per_node "$nproc")
else launcher=("$python"); fi
echo "run_tiny.sh: norm_type=$norm_type post_num=${post_num:-none} processes=$nproc threads=$OMP_NUM_THREADS (CPU)"
exec bash utils/launch/launch_trainer.sh "${launcher[@]}" torchrun_main.py \
    --model_config configs/llama_tiny_deep.json \
    --norm_type "$norm_type" ${post_num:+--post_num "$post_num"} \
    --dataset embedded \
    --device cpu \
    --dtype float32 \
    --lr 2e-3 \
    --batch_size 8 \
    --total_batch_size $((8 * nproc)) \
    --max_length 128 \
    --num_training_steps 150 \
    --warmup_steps 15 \
    --weight_decay 0 \
    --grad_clipping 1.0 \
    --eval_every 50 \
    --eval_tokens 20000 \
    --save_every 150 \
    --workers 0 \
    --run_name "$run_name" \
    "$@"
