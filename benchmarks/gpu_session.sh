#!/usr/bin/env bash
# Everything tfun checks and measures on a CUDA machine, as one command that fits the device
# tool's limits (one run of at most 10 minutes, 15 minutes of device time a session): the GPU
# correctness script, the kernel tests on real CUDA, the GPU benchmarks, then as much of the
# suite as the time left allows. Logs and a summary go to $OUT (the device tool brings back at
# most 8 files). DEVELOPERS.md, "On a GPU", says how a session uses it.
#
#   bash benchmarks/gpu_session.sh --fetch-wheels   # here, before: the packages the GPU image
#                                                   # lacks (optree, typeguard) into .whl/
#   bash benchmarks/gpu_session.sh                  # there: device tool `run` with carry [".whl"]
#
# GPU_BUDGET_S (default 540) is the time the steps may take together; each step also has a
# limit of its own, so one that hangs leaves time for the next.
set -u
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--fetch-wheels" ]; then
    # the versions this checkout's venv runs, for the GPU image's Python 3.12
    py=${PYTHON:-.venv/bin/python}
    optree=$("$py" -c "import importlib.metadata as m; print(m.version('optree'))")
    typeguard=$("$py" -c "import importlib.metadata as m; print(m.version('typeguard'))")
    rm -rf .whl && mkdir -p .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "optree==$optree" "typeguard==$typeguard"
    ls .whl
    exit 0
fi

OUT=${OUT:-/tmp/tfun-gpu-out}
mkdir -p "$OUT"
start=$SECONDS
budget=${GPU_BUDGET_S:-540}

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX beside torch on one GPU

step() {  # step NAME MAX_SECONDS COMMAND...: run, log to $OUT/NAME.log, one summary line
    local name=$1 max=$2
    shift 2
    local left=$((budget - (SECONDS - start)))
    if [ "$left" -lt 20 ]; then
        echo "$name: skipped, no time left" | tee -a "$OUT/summary.txt"
        return
    fi
    [ "$max" -gt "$left" ] && max=$left
    local t=$SECONDS
    timeout -k 5 "$max" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc in $((SECONDS - t)) s (limit $max s): $*" | tee -a "$OUT/summary.txt"
    tail -n 15 "$OUT/$name.log"
}

step env 60 python3 -c "import torch, triton, jax, optree, tfun; print('torch', torch.__version__, torch.cuda.get_device_name(), '| triton', triton.__version__, '| jax', jax.__version__, jax.devices(), '| optree', optree.__version__)"
step check_cuda 150 python3 -m tests.gpu.check_cuda
step kernel_tests 120 python3 -m pytest -q -p no:cacheprovider -n 4 tests/kernels tests/gpu
step vs_jax 120 python3 benchmarks/vs_jax.py --quick --device cuda
step linear_scan 60 python3 benchmarks/linear_scan.py --quick --reps 3 --max-seconds 5
# -v: each result as it comes, so a suite cut off by the time limit still says what failed
step suite 9999 python3 -m pytest -v -p no:cacheprovider -n 8 tests --ignore=tests/jax_port -m "not heavy"
if [ -f "$OUT/suite.log" ]; then
    echo "suite: $(grep -c ' PASSED' "$OUT/suite.log") passed, $(grep -cE ' (FAILED|ERROR)' "$OUT/suite.log") failed or errors" | tee -a "$OUT/summary.txt"
    grep -E ' (FAILED|ERROR) ' "$OUT/suite.log" | head -40 | tee -a "$OUT/summary.txt"
fi
echo "total: $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
