# The arguments every run script takes: NORM_TYPE [POST_NUM] [extra torchrun_main.py flags]. Sourced by run_tiny.sh
# and utils/gpu/gpu_recipe.sh after they set `script`: sets norm_type and post_num, and leaves the extra flags in "$@".
if [[ $# -eq 0 ]]; then  # bad input: exit 2, as the trainer's own bad-input errors
    echo "$script: error: usage: bash $script NORM_TYPE [POST_NUM] [extra torchrun_main.py flags]" >&2
    exit 2
fi
norm_type=$1
shift
post_num=""
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then post_num=$1; shift; fi
