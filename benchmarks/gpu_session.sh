#!/usr/bin/env bash
# Everything tfun checks and measures on a CUDA machine, as one command that fits the device
# tool's limits (one run of at most 10 minutes, 15 minutes of device time a session): first,
# side by side, the GPU correctness script, the kernel tests compiled for CUDA and the whole
# suite; then, alone on the machine, the GPU benchmarks. Logs and a summary go to $OUT (the
# device tool brings back at most 8 files). DEVELOPERS.md, "On a GPU", says how a session uses it.
#
#   bash benchmarks/gpu_session.sh --fetch-wheels   # here, before: the packages the GPU image
#                                                   # lacks (optree, typeguard) into .whl/
#   bash benchmarks/gpu_session.sh                  # there: device tool `run` with carry [".whl"]
#
# A second call can skip what the first finished: GPU_SUITE_DONE=path/suite.log (a first call's
# log, copied into an ignored folder of the checkout and carried) deselects the tests that
# passed, were skipped or xfailed there; GPU_CHECK_ONLY=NAME runs only check_cuda's cases whose
# name contains NAME.
#
# GPU_SUITE_PATHS="tests/a.py tests/b" runs only those parts of the suite (the rest ran on an
# earlier device call; docs/compatibility.md says which).
#
# GPU_SKIP_BENCH=1 stops after the correctness phase (a caller that runs its own benchmarks).
# GPU_SWEEP=1 adds the Triton linear_scan tile/warp sweep to the benchmarks (about 3 minutes).
# GPU_BUDGET_S (default 560) is the time the steps may take together; each step also has a
# limit of its own (GPU_PHASE1_S, default 330, for the correctness phase), so one that hangs
# leaves time for the next.
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
budget=${GPU_BUDGET_S:-560}

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

# Phase 1, correctness, side by side (mostly CPU-bound compiling; the GPU is shared): the GPU
# correctness script in six shards (three were too few in session 16: the third was cut at its
# limit in both calls, each process paying about 90 s for its first Inductor compile; four took
# 233-279 s of their 330 in session 34, before the `+nograd` and compiled-kernel rows), the kernel
# tests compiled for CUDA (twice: with the default reverse-order tiles, "rising", and with
# TFUN_LINEAR_SCAN_REVERSE_TILES=falling, the earlier default of
# tfun/kernels/_linear_scan_triton.py's `Knobs.reverse_tiles`; the tests that run both layouts
# themselves are left out of the second run), and the whole suite (JAX on the CPU there, as on CI:
# it is the oracle; the full check_cuda cell is its own step).
phase1=${GPU_PHASE1_S:-330}
step env 60 python3 -c "import torch, triton, jax, optree, tfun; print('torch', torch.__version__, torch.cuda.get_device_name(), '| triton', triton.__version__, '| jax', jax.__version__, jax.devices(), '| optree', optree.__version__)"
for k in 0 1 2 3 4 5; do
    TORCHINDUCTOR_COMPILE_THREADS=2 step "check_cuda_$k" "$phase1" python3 -m tests.gpu.check_cuda --shard "$k/6" \
        --only "${GPU_CHECK_ONLY:-}" &
done
TFUN_KERNEL_DEVICE=cuda step kernel_tests "$phase1" python3 -m pytest -q -p no:cacheprovider -n 2 tests/kernels &
TFUN_KERNEL_DEVICE=cuda TFUN_LINEAR_SCAN_REVERSE_TILES=falling step kernel_tests_falling "$phase1" \
    python3 -m pytest -q -p no:cacheprovider -n 2 tests/kernels -k "not reverse_tiles and not rising_tiles" &
# -v: each result as it comes, so a suite cut off by the time limit still says what failed
deselect=(--deselect tests/gpu/test_check_cuda.py::test_full_check_on_cuda)
if [ -n "${GPU_SUITE_DONE:-}" ]; then
    while read -r id; do deselect+=(--deselect "$id"); done < <(
        grep -oE '(PASSED|SKIPPED|XFAIL|XPASS) tests/[^ ]+' "$GPU_SUITE_DONE" | awk '{print $2}' | sort -u)
    echo "suite: ${#deselect[@]} arguments deselect what passed in $GPU_SUITE_DONE" | tee -a "$OUT/summary.txt"
fi
# GPU_SUITE_PATHS (default: tests) narrows the suite to what changed since the last device call
# shellcheck disable=SC2086
JAX_PLATFORMS=cpu TORCHINDUCTOR_COMPILE_THREADS=1 step suite "$phase1" python3 -m pytest -v -p no:cacheprovider -n 10 \
    ${GPU_SUITE_PATHS:-tests} "${deselect[@]}"
wait
cat "$OUT"/check_cuda_?.log >"$OUT/check_cuda.log" && rm -f "$OUT"/check_cuda_?.log  # 8 files come back at most
merge() {  # merge INTO PART...: the parts' logs into INTO.log, each under a header (8 files come back)
    local into=$1 part
    shift
    for part in "$@"; do
        if [ -f "$OUT/$part.log" ]; then echo "===== $part.log"; cat "$OUT/$part.log"; fi
    done >"$OUT/$into.tmp"
    for part in "$@"; do rm -f "$OUT/$part.log"; done
    mv "$OUT/$into.tmp" "$OUT/$into.log"
}
merge kernel_tests kernel_tests kernel_tests_falling
echo "check_cuda: $(grep -c ' | ok | ' "$OUT/check_cuda.log") ok, $(grep -cE ' \| (WRONG|CRASH) \| ' "$OUT/check_cuda.log") wrong or crashed, $(grep -c ' | REFUSED | ' "$OUT/check_cuda.log") refused" | tee -a "$OUT/summary.txt"
grep -E ' \| (WRONG|CRASH) \| ' "$OUT/check_cuda.log" | head -30 | tee -a "$OUT/summary.txt"
if [ -f "$OUT/suite.log" ]; then
    echo "suite: $(grep -c ' PASSED' "$OUT/suite.log") passed, $(grep -cE ' (FAILED|ERROR)' "$OUT/suite.log") failed or errors" | tee -a "$OUT/summary.txt"
    grep -E ' (FAILED|ERROR) ' "$OUT/suite.log" | head -40 | tee -a "$OUT/summary.txt"
fi

# Phase 2, speed, on the machine with nothing else running (GPU_SKIP_BENCH=1: not now)
if [ "${GPU_SKIP_BENCH:-0}" != 1 ]; then
    # linear_scan's kernel at a bandwidth-bound size, once with each reverse-order tile layout
    # (the fwd+bwd rows run the backward in reverse order; fwd is the same kernel in both), first
    # and back to back, so that the time left for the longer steps below cannot squeeze them out
    for tiles in falling rising; do
        TFUN_LINEAR_SCAN_REVERSE_TILES=$tiles step "linear_scan_$tiles" 45 python3 benchmarks/linear_scan.py \
            --bd 65536 --T 4096 --paths triton --reps 5 --max-seconds 5
    done
    # GPU_SWEEP=1: the Triton kernel's tiles x warps at the same size, fwd+bwd (27 configurations
    # per dtype, a compile each): what the backward's bandwidth gap (77% fp32, 56% bf16 on an
    # H200) might be made of
    if [ "${GPU_SWEEP:-0}" = 1 ]; then
        step linear_scan_sweep 180 python3 benchmarks/linear_scan.py --bd 65536 --T 4096 --modes fwd+bwd \
            --sweep --reps 3 --max-seconds 3
    fi
    merge linear_scan linear_scan_falling linear_scan_rising linear_scan_sweep
    # tfun.jit with its default cuda_graphs="auto" (--no-cuda-graphs: plain; those numbers are in RESULTS.md)
    step vs_jax ${GPU_VS_JAX_S:-170} python3 benchmarks/vs_jax.py --quick --device cuda
    # tfun.nn's RNN layers against cuDNN (torch.nn.LSTM/GRU), eager and jitted
    step nn 90 python3 benchmarks/nn.py --device cuda --only lstm --quick
    step cuda_graphs 90 python3 benchmarks/cuda_graphs.py --strategies jit tfun_cuda_graphs jax --max-seconds 20 --repeat 5
    merge cuda_graphs cuda_graphs nn  # 8 files come back at most
fi
echo "total: $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
