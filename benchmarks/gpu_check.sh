#!/usr/bin/env bash
# Everything a CUDA machine should check: the CUDA tests, then the GPU
# benchmarks. Each step's output goes to its own file in OUT_DIR (default
# benchmarks/out), and a failing step does not stop the ones after it; the exit
# status is the number of steps that failed.
#
#     bash benchmarks/gpu_check.sh                # all of it
#     OUT_DIR=/tmp/gpu bash benchmarks/gpu_check.sh tests overhead   # only these steps
#
# Steps: tests overhead compile startup data_wait profile launch (launch needs 2 GPUs).
# Together they run for well over ten minutes on one GPU (compile alone trains GPT-2 for 6,000
# steps); where a call has a time limit, give one step per call.
set -u
cd "$(dirname "$0")/.."
out=${OUT_DIR:-benchmarks/out}
mkdir -p "$out"
steps=${*:-tests overhead compile startup data_wait profile launch}
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/device.txt" 2>&1
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" >> "$out/device.txt"

failed=0
run() {  # run NAME COMMAND...: the command's output in $out/NAME.txt, timed
    local name=$1; shift
    echo "== $name: $*"
    local start=$SECONDS
    "$@" > "$out/$name.txt" 2>&1
    local status=$?
    echo "   exit $status after $((SECONDS - start)) s ($out/$name.txt)"
    [ $status -eq 0 ] || failed=$((failed + 1))
}

for step in $steps; do
    case $step in
        # the files that hold CUDA tests (by their marker): the rest of the suite needs the
        # notebook stack (IPython, nbformat, tornado), which a bare GPU machine may lack
        tests) run tests python -m pytest -p no:cacheprovider -o addopts="" -m cuda -rs -v \
                   $(grep -l "mark.cuda" tests/test_*.py) ;;
        overhead) run overhead python benchmarks/overhead.py ;;
        compile) run compile python benchmarks/compile_auto.py ;;
        startup) run startup python benchmarks/startup.py --device cuda ;;
        data_wait) run data_wait python benchmarks/data_wait.py ;;
        profile) run profile python benchmarks/profile_overhead.py ;;
        launch)
            if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
                run launch python benchmarks/launch.py --accelerator cuda
            else
                echo "== launch: skipped (one GPU)"
            fi ;;
        *) echo "unknown step: $step" >&2; failed=$((failed + 1)) ;;
    esac
done
exit $failed
