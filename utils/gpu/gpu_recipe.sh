# Launches one of the paper's GPU recipes. Sourced by run_130m.sh, run_250m.sh, run_350m.sh and run_1b.sh, which set
# `script`, `size`, `recipe_processes`, `lr` and `recipe` (what differs between them); their arguments are
#   NORM_TYPE [POST_NUM] [extra torchrun_main.py flags]
# Extra flags come last, so they override the recipe's (e.g. --dtype mixed, --fsdp, --no_compile, --resume auto).
#   NPROC=<n>      processes on this node. Default: the recipe's count or the visible GPUs, whichever is fewer; the
#                  total batch of 512 is kept through gradient accumulation (utils/gpu/gpu_processes.py). A machine
#                  without CUDA is refused in one line (exit 2), pointing to run_tiny.sh, unless --device cpu.
#   TORCHRUN_ARGS  replaces "--standalone" (multi-node).
#   torch.compile  on by default on CUDA (the same math, 2-3x the eager step); --no_compile opts out.
#   Signals        SIGTERM or SIGUSR1 (a scheduler's time limit or preemption) make every rank finish its update,
#                  save and exit 5; the same command with --resume auto continues the run exactly
#                  (utils/launch/launch_trainer.sh, docs/reliability.md).
# Exit code: docs/training.md#exit-codes (each rank's own code, read back by utils/launch/launch_trainer.sh).
source utils/launch/run_arguments.sh
run_name="${size}_${norm_type,,}"
if [[ ${norm_type,,} == post_pre && -n $post_num ]]; then run_name+="_post$post_num"; fi
run_name+="_lr$lr"
# The reference run scripts' settings shared by every size: 512 sequences of 256 tokens per update, pure bf16, Adam
# without weight decay or clipping.
shared=(--total_batch_size 512 --max_length 256 --dtype bfloat16 --optimizer adam --weight_decay 0 --grad_clipping 0.0
        --eval_every 1000)
# shellcheck disable=SC2154  # recipe is set by the run script
trainer_flags=("${recipe[@]}" "${shared[@]}" --norm_type "$norm_type" ${post_num:+--post_num "$post_num"}
               --run_name "$run_name")
plan=$(python utils/gpu/gpu_processes.py "$script" "$recipe_processes" -- "${trainer_flags[@]}" "$@") || exit $?
read -r nproc compile <<<"$plan"
if [[ $compile == 1 ]]; then trainer_flags+=(--compile); fi

echo "$script: norm_type=$norm_type post_num=${post_num:-none} lr=$lr processes=$nproc compile=$compile"
# shellcheck disable=SC2086  # TORCHRUN_ARGS is a list of flags
exec bash utils/launch/launch_trainer.sh torchrun ${TORCHRUN_ARGS:---standalone} --nproc_per_node "$nproc" torchrun_main.py \
    "${trainer_flags[@]}" "$@"
