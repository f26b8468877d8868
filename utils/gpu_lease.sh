#!/usr/bin/env bash
# One lent GPU's two prepared calls, run on the device from the project root with the wheels of
# ../shared/tools/gpu_wheels.sh carried in .whl/ (docs/benchmarks.md#a-gpu-lease):
#   bash utils/gpu_lease.sh check OUT [gpu_check.sh flags]   # utils/gpu_check.sh: recipes, FSDP stop-and-resume, ...
#   bash utils/gpu_lease.sh width_sweep OUT [width_sweep.py flags]   # the width sweep's GPU widths (resumable:
#                                                                    # records land as runs end)
#   bash utils/gpu_lease.sh rehearse OUT     # both, on this machine's CPU at tiny sizes, through the same lines (CI)
# Installs the wheels, gives the image the `python` and `torchrun` a GPU node has, and leaves every result in OUT
# as at most 8 small files (the width sweep's records as one tarball, rewritten as each run ends).
set -uo pipefail
what=$1 out=$2
shift 2
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled
if [[ $what == rehearse ]]; then
    start=$(date +%s) wheels=0
    # The packages the image lacks come as the wheels of ../shared/tools/gpu_wheels.sh, at the pinned versions; the
    # rehearsal installs none (they are the device's Python's), it checks that each is there.
    if [[ -d .whl ]]; then
        for pin in $(grep -ihE '^(transformers|tokenizers|datasets|lm_eval|liger-kernel)==' exp_requirements.txt \
                     gpu_requirements.txt); do
            name=${pin%%==*}
            if ! compgen -G ".whl/${name//-/_}-${pin##*==}-*.whl" >/dev/null; then
                echo "gpu_lease.sh rehearse: .whl has no wheel of $pin: run bash ../shared/tools/gpu_wheels.sh"
                wheels=1
            fi
        done
    else
        echo "gpu_lease.sh rehearse: no .whl here; a lease carries the wheels of bash ../shared/tools/gpu_wheels.sh"
    fi
    # side by side: both are mostly single-threaded process start-ups here, so two cores take both at once
    GPU_LEASE_REHEARSAL=1 bash "$0" width_sweep "$out/width_sweep" --rehearse >"$out/width_sweep.out" 2>&1 &
    sweeping=$!
    GPU_LEASE_REHEARSAL=1 bash "$0" check "$out/check" --rehearse "$@"; check=$?
    wait $sweeping; sweep=$?
    cat "$out/width_sweep.out"
    echo "gpu_lease.sh rehearse: wheels $([[ $wheels == 0 ]] && echo ok || echo MISSING), check exit $check," \
         "width_sweep exit $sweep, $(( $(date +%s) - start )) s in all"
    exit $(( wheels || check || sweep ))
fi
if [[ -d .whl && -z ${GPU_LEASE_REHEARSAL:-} ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl >"$out/pip.log" 2>&1 || { echo "gpu_lease.sh: pip install failed (see pip.log)"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD  # the repository's packages: the image has no `pip install -e .`
bin=$(mktemp -d)
command -v python >/dev/null || printf '#!/bin/sh\nexec python3 "$@"\n' >"$bin/python"
command -v torchrun >/dev/null || printf '#!/bin/sh\nexec python3 -m torch.distributed.run "$@"\n' >"$bin/torchrun"
chmod +x "$bin"/* 2>/dev/null; export PATH=$bin:$PATH
start=$(date +%s)
case $what in
    check)
        bash utils/gpu_check.sh "$out/check" "$@"; code=$?
        cp "$out"/check/gpu_check.md "$out"/check/gpu_check.json "$out"/ 2>/dev/null
        tar czf "$out/check_logs.tgz" -C "$out/check" --exclude fixtures --exclude runs . 2>/dev/null
        rm -rf "$out/check";;
    width_sweep)
        # The GPU's command (utils/gpu_check.py's WIDTH_SWEEP plans from the same flags); --rehearse appends the
        # CPU's (the last of a flag wins): the quick budget's tiny widths, in float32 (no bf16 instructions here),
        # two jobs on two cores, checkpoints deleted as on a GPU, records into OUT
        sweep=(--budget gpu --device cuda --widths 512 768 1024 --runs_dir /tmp/width_runs --no-compile --jobs 6)
        folder=docs/width_sweep_mixed_cuda
        if [[ ${1:-} == --rehearse ]]; then
            shift
            folder=$out/width_sweep_rehearsal
            sweep+=(--budget quick --device cpu --widths 16 32 --runs_dir "$out/width_runs" --out "$folder"
                    --no-keep_checkpoints --dtype float32 --jobs 2)
        fi
        (while sleep 20; do tar czf "$out/width_sweep_gpu.tgz.part" "$folder" 2>/dev/null \
            && mv "$out/width_sweep_gpu.tgz.part" "$out/width_sweep_gpu.tgz"; done) &
        saver=$!
        python utils/width_sweep.py "${sweep[@]}" "$@" 2>&1 | tee "$out/width_sweep.log" | grep -v -i warn | tail -40
        code=${PIPESTATUS[0]}
        kill $saver 2>/dev/null
        tar czf "$out/width_sweep_gpu.tgz" "$folder" 2>/dev/null; rm -f "$out/width_sweep_gpu.tgz.part";;
    *) echo "gpu_lease.sh: error: the first argument must be check, width_sweep or rehearse, got '$what'" >&2; exit 2;;
esac
rm -rf "$bin"
echo "gpu_lease.sh $what: exit $code after $(( $(date +%s) - start )) s"
exit $code
