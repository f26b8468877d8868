#!/usr/bin/env bash
# One lent GPU's two prepared calls, run on the device from the project root with the wheels of
# ../shared/tools/gpu_wheels.sh carried in .whl/ (docs/benchmarks.md#a-gpu-lease):
#   bash utils/gpu_lease.sh check OUT        # utils/gpu_check.sh: recipes, FSDP stop-and-resume, bare steps, ...
#   bash utils/gpu_lease.sh width_sweep OUT  # the width sweep's GPU widths (resumable: records land as runs end)
# Installs the wheels, gives the image the `python` and `torchrun` a GPU node has, and leaves every result in OUT
# as at most 8 small files (the width sweep's records as one tarball, rewritten as each run ends).
set -uo pipefail
what=$1 out=$2
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled
if [[ -d .whl ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl >"$out/pip.log" 2>&1 || { echo "gpu_lease.sh: pip install failed (see pip.log)"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
fi
mkdir -p /tmp/bin
command -v python >/dev/null || printf '#!/bin/sh\nexec python3 "$@"\n' >/tmp/bin/python
command -v torchrun >/dev/null || printf '#!/bin/sh\nexec python3 -m torch.distributed.run "$@"\n' >/tmp/bin/torchrun
chmod +x /tmp/bin/* 2>/dev/null; export PATH=/tmp/bin:$PATH
start=$(date +%s)
case $what in
    check)
        shift 2
        bash utils/gpu_check.sh "$out/check" "$@"; code=$?
        cp "$out"/check/gpu_check.md "$out"/check/gpu_check.json "$out"/ 2>/dev/null
        tar czf "$out/check_logs.tgz" -C "$out/check" --exclude fixtures --exclude runs . 2>/dev/null
        rm -rf "$out/check";;
    width_sweep)
        shift 2
        folder=docs/width_sweep_mixed_cuda
        (while sleep 20; do tar czf "$out/width_sweep_gpu.tgz.part" "$folder" 2>/dev/null \
            && mv "$out/width_sweep_gpu.tgz.part" "$out/width_sweep_gpu.tgz"; done) &
        saver=$!
        python utils/width_sweep.py --budget gpu --device cuda --no-compile --widths 512 768 1024 --jobs 6 \
            --runs_dir /tmp/width_runs "$@" 2>&1 | tee "$out/width_sweep.log" | grep -v -i warn | tail -40
        code=${PIPESTATUS[0]}
        kill $saver 2>/dev/null
        tar czf "$out/width_sweep_gpu.tgz" "$folder" 2>/dev/null; rm -f "$out/width_sweep_gpu.tgz.part";;
    *) echo "gpu_lease.sh: error: the first argument must be check or width_sweep, got '$what'" >&2; exit 2;;
esac
echo "gpu_lease.sh $what: exit $code after $(( $(date +%s) - start )) s"
exit $code
