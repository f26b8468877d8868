#!/usr/bin/env bash
# One lent GPU's prepared calls, run on the device from the project root with the wheels of
# ../shared/tools/gpu_wheels.sh carried in .whl/ (docs/benchmarks.md#a-gpu-lease):
#   bash utils/gpu/gpu_lease.sh check OUT [gpu_check.sh flags]   # utils/gpu/gpu_check.sh: recipes, FSDP stop-and-resume, ...
#   bash utils/gpu/gpu_lease.sh width_sweep OUT [width_sweep.py flags]   # the width sweep's GPU widths (resumable:
#                                                                    # records land as runs end)
#   bash utils/gpu/gpu_lease.sh rehearse OUT     # both, on this machine's CPU at tiny sizes, through the same lines (CI)
# and the Wikipedia depth sweep at hidden 768 (issue 68; docs/gpu.md), carried in .lease/ (git-ignored):
#   bash utils/gpu/gpu_lease.sh prepare_wikipedia    # here, before the call: the corpus and wheels into .lease/, and
#                                                # the travel check (fails above 60 MiB)
#   bash utils/gpu/gpu_lease.sh wikipedia_depth OUT [depth_sweep.py flags]  # on the device: seed 1's six runs, one wave
#   bash utils/gpu/gpu_lease.sh rehearse_wikipedia OUT   # the same lines on this machine's CPU at tiny sizes (CI)
# Installs the wheels, gives the image the `python` and `torchrun` a GPU node has, and leaves every result in OUT
# as at most 8 small files (a sweep's records as one tarball, rewritten as each run ends).
set -uo pipefail
what=${1:-}
lease=.lease
if [[ $what == prepare_wikipedia ]]; then
    # The corpus as one xz tarball of its text (made once), the wheels of what the image lacks for the study (its
    # own transformers 5.17 and tokenizers 0.23.2 serve: docs/gpu.md), then what the call would send, measured.
    mkdir -p "$lease/whl"
    if [[ ! -s $lease/wikipedia.tar.xz ]]; then
        python -m utils.gpu.gpu_carry pack_corpus --out "$lease/wikipedia.tar.xz" || exit
    fi
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$lease/whl" $(grep -ihE '^(datasets|lm_eval)==' exp_requirements.txt) "dill<0.4.2" \
        "multiprocess<0.70.20" more-itertools==11.2.1 || { echo "gpu_lease.sh prepare_wikipedia: pip download failed"; exit 1; }
    ls -1 "$lease" "$lease/whl"
    exec python -m utils.gpu.gpu_carry travel --carry "$lease"
fi
if [[ $# -lt 2 ]]; then
    echo "gpu_lease.sh: error: give what and OUT (check, width_sweep, rehearse, wikipedia_depth or" \
         "rehearse_wikipedia, then a folder); prepare_wikipedia takes none" >&2
    exit 2
fi
out=$2
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
if [[ $what == rehearse_wikipedia ]]; then
    # The Wikipedia call's lines on this CPU: a tiny corpus of the same shape packed and carried as the real one
    # is, the travel check on what a call would send from here (the tree and a prepared .lease/), then the call.
    start=$(date +%s)
    python -m utils.gpu.gpu_carry rehearsal_corpus --out "$out/corpus" >/dev/null \
        && python -m utils.gpu.gpu_carry pack_corpus --corpus "$out/corpus" --out "$out/rehearsal.tar.xz" || exit
    python -m utils.gpu.gpu_carry travel --carry "$lease"; travel=$?
    for pin in $(grep -ihE '^(datasets|lm_eval)==' exp_requirements.txt); do  # a prepared lease has the pinned wheels
        if [[ -s $lease/wikipedia.tar.xz ]] && ! compgen -G "$lease/whl/${pin%%==*}-${pin##*==}-*.whl" >/dev/null; then
            echo "gpu_lease.sh rehearse_wikipedia: $lease/whl has no wheel of $pin: run prepare_wikipedia"
            travel=1
        fi
    done
    GPU_LEASE_REHEARSAL=1 GPU_LEASE_CORPUS=$out/rehearsal.tar.xz bash "$0" wikipedia_depth "$out/wikipedia_depth" \
        --rehearse; sweep=$?
    echo "gpu_lease.sh rehearse_wikipedia: travel $([[ $travel == 0 ]] && echo ok || echo OVER), wikipedia_depth" \
         "exit $sweep, $(( $(date +%s) - start )) s in all"
    exit $(( travel || sweep ))
fi
wheels=.whl
[[ $what == wikipedia_depth ]] && wheels=$lease/whl  # the Wikipedia call carries .lease alone
if [[ -d $wheels && -z ${GPU_LEASE_REHEARSAL:-} ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$wheels"/*.whl >"$out/pip.log" 2>&1 || { echo "gpu_lease.sh: pip install failed (see pip.log)"; exit 1; }
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
        bash utils/gpu/gpu_check.sh "$out/check" "$@"; code=$?
        cp "$out"/check/gpu_check.md "$out"/check/gpu_check.json "$out"/ 2>/dev/null
        tar czf "$out/check_logs.tgz" -C "$out/check" --exclude fixtures --exclude runs . 2>/dev/null
        rm -rf "$out/check";;
    width_sweep)
        # The GPU's command (utils/gpu/gpu_check.py's WIDTH_SWEEP plans from the same flags); --rehearse appends the
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
    wikipedia_depth)
        # The GPU's command: one wave, seed 1's six runs at once (a later call appends --seeds 1 2: seed 1's
        # committed records are reused, seed 2's six train); --rehearse appends the CPU's: the tiny budget, float32,
        # seed 1's four runs, records into OUT (the last of a flag wins). The corpus travels as text, unpacked here.
        sweep=(--budget wikipedia_gpu --device cuda --no-compile --jobs 6 --seeds 1
               --runs_dir /tmp/wikipedia_gpu_runs)
        folder=docs/depth_sweep_wikipedia_gpu_mixed_cuda
        runs=/tmp/wikipedia_gpu_runs corpus=/tmp/wikipedia_corpus
        if [[ ${1:-} == --rehearse ]]; then
            shift
            folder=$out/depth_sweep_rehearsal runs=$out/wikipedia_runs corpus=$out/wikipedia_corpus
            sweep+=(--budget wikipedia_gpu_quick --device cpu --jobs 4 --runs_dir "$runs" --out "$folder"
                    --dtype float32)
        fi
        python -m utils.gpu.gpu_carry unpack_corpus --archive "${GPU_LEASE_CORPUS:-$lease/wikipedia.tar.xz}" \
            --out "$corpus" || exit
        export WIKIPEDIA_DATA_DIR=$corpus
        python utils/depth_sweep.py "${sweep[@]}" "$@" --estimate | tee "$out/plan.txt" || exit
        # the records (never a checkpoint: those stay under --runs_dir) and the run logs, as each run ends
        pack() {
            tar czf "$out/wikipedia_gpu.tgz.part" "$folder" 2>/dev/null \
                && mv "$out/wikipedia_gpu.tgz.part" "$out/wikipedia_gpu.tgz"
            tar czf "$out/logs.tgz.part" -C "$runs" logs 2>/dev/null && mv "$out/logs.tgz.part" "$out/logs.tgz"
        }
        (while sleep 20; do pack; done) &
        saver=$!
        python utils/depth_sweep.py "${sweep[@]}" "$@" 2>&1 | tee "$out/wikipedia_depth.log" | grep -v -i warn | tail -40
        code=${PIPESTATUS[0]}
        kill $saver 2>/dev/null; wait $saver 2>/dev/null
        pack; rm -f "$out"/*.part;;
    *) echo "gpu_lease.sh: error: the first argument must be check, width_sweep, rehearse, prepare_wikipedia," \
            "wikipedia_depth or rehearse_wikipedia, got '$what'" >&2; exit 2;;
esac
rm -rf "$bin"
echo "gpu_lease.sh $what: exit $code after $(( $(date +%s) - start )) s"
exit $code
