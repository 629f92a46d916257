#!/usr/bin/env bash
# The device check of docs/gpu.md in one call of the lent GPU machine (15 minutes of
# device time in all). Steps, in the order named (when none is named: bench sinkchunk tests
# long q4: the short missing rows, the evicting chunk that decides the engine's, the tests'
# messages, then the long rows), each run while the deadline leaves it its limit, so that
# the call ends before DEADLINE seconds:
#
#   packed   decode on packed tokens against dense attention on mx.gpu (MLX's kernels)
#   peak     MLX's peak at 32,768, one process per probe: the 4-bit and 8-bit caches
#   peakfull the same for the full cache (mlxkv's, mlx-lm's, sized before its prefill),
#            then the full and 4-bit caches under smaller CUDA graphs
#   bench    sink + 4-bit and plain-key 4-bit KV at 4,096 against mlx-lm
#   long     4-bit KV at 131,072, one round
#   bench4k  full and sink + window at 4,096
#   q4       4-bit KV with 4-bit weights at 4,096
#   plain    4-bit KV with plain keys beside KIVI's at 32,768 and 4,096
#   sinkchunk  sink + window at 32,768, evicting prefill chunks of 64, 512 and 256 tokens
#   tests    the GPU-rule tests on mx.gpu
#
#   bash benchmarks/gpu_device.sh WHEEL_DIR|- OUT_DIR [DEADLINE] [STEP...]
#
# WHEEL_DIR: the carried wheels, installed once per machine ("-": use the MLX at hand).
# The device tool brings back at most 8 files from OUT_DIR, so every log and result goes
# into one archive, OUT_DIR/results.tgz, rewritten after each step; the console names each
# step's outcome and its key numbers. Weights are bfloat16 except in q4.
#
# MLX's CUDA backend compiles each kernel at its first use (minutes on a fresh machine) and
# keeps the binaries in MLX_PTX_CACHE_DIR. The script brings them back as
# OUT_DIR/kernels.tgz (when under the device tool's 16 MiB per file), and installs a
# WHEEL_DIR/kernels.tgz carried with the wheels: the next machine, with the same MLX and
# GPU architecture, then builds only what is new.
set -u
wheels=$1
out=$2
deadline=${3:-540}
shift $(($# < 3 ? $# : 3))
steps=${*:-bench sinkchunk tests long q4}
mkdir -p "$out"
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-device.XXXXXX")
keep() { tar -czf "$out/results.tgz" -C "$work" .; }
if [ "$wheels" != - ] && [ ! -d /tmp/site/mlx ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site "$wheels"/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:. MLXKV_BLAS=reference PYTHONUNBUFFERED=1
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-${TMPDIR:-/tmp}/mlx-kernels}
mkdir -p "$MLX_PTX_CACHE_DIR"
if [ "$wheels" != - ] && [ -f "$wheels/kernels.tgz" ]; then
    tar -xzf "$wheels/kernels.tgz" -C "$MLX_PTX_CACHE_DIR"
    echo "kernels carried: $(find "$MLX_PTX_CACHE_DIR" -type f | wc -l) files"
fi
save_kernels() {  # the compiled kernels into OUT_DIR, if any and if they fit
    local n
    n=$(find "$MLX_PTX_CACHE_DIR" -type f | wc -l)
    [ "$n" -gt 0 ] || return 0
    tar -czf "$out/kernels.tgz" -C "$MLX_PTX_CACHE_DIR" .
    local size
    size=$(stat -c %s "$out/kernels.tgz")
    if [ "$size" -gt 16000000 ]; then
        rm "$out/kernels.tgz"
        echo "kernels: $n files, $size bytes packed: over 16 MiB, not kept"
    else
        echo "kernels: $n files in OUT_DIR/kernels.tgz ($size bytes)"
    fi
}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
        --format=csv 2>&1
    python3 -c "import mlx.core as mx; from mlxkv.memory.dtypes import backend; \
print(mx.__version__, mx.default_device(), mx.device_info(), backend())" 2>&1
} | tee "$work/device.txt"
keep

wanted() {  # STEP LIMIT: whether STEP's limit fits before the deadline
    if [ $((SECONDS + $2)) -gt "$deadline" ]; then
        echo "$1 skipped at ${SECONDS} s: its ${2} s would pass the deadline of ${deadline} s"
        return 1
    fi
}

# -v prints each test's result as it ends, so a run stopped at its limit still names them.
pytest=(python3 -m pytest -v -m "not slow" -p no:cacheprovider --timeout 100)
step_packed() {
    wanted packed 150 || return
    timeout 150 "${pytest[@]}" --tb=short tests/test_packed_attention.py >"$work/packed.log" 2>&1
    echo "packed exit $? at ${SECONDS} s"
    grep -E "PASSED|FAILED|ERROR|^E " "$work/packed.log" | sed 's/^tests.*\[//' | head -n 12
    keep
}

# One process per setting (MLX reads them when it starts), all at 32,768 in bfloat16.
peak() {  # ARGS... (MLX's settings in the environment)
    wanted peak 45 || return
    timeout 45 python3 benchmarks/gpu_peak.py --context 32768 "$@" >>"$work/peak.jsonl" \
        2>>"$work/peak.log"
    echo "peak exit $? at ${SECONDS} s: $(tail -n 1 "$work/peak.log")"
    keep
}
step_peak() {  # the quantized caches, whose prefill masks changed after their last probe
    peak --policy 4bit
    peak --policy 8bit
}
step_peakfull() {
    peak --policy full
    peak --policy full --side mlx-lm
    peak --policy full --presize
    MLX_MAX_OPS_PER_BUFFER=20 MLX_MAX_MB_PER_BUFFER=100 peak --policy full
    MLX_MAX_OPS_PER_BUFFER=20 MLX_MAX_MB_PER_BUFFER=100 peak --policy 4bit
}

bench() {  # NAME TIMEOUT ARGS...
    local name=$1 limit=$2
    shift 2
    wanted "$name" "$limit" || return
    timeout "$limit" python3 benchmarks/gpu_bench.py "$@" --out "$work/$name" \
        2>"$work/$name.log" >/dev/null
    echo "$name exit $? at ${SECONDS} s"
    grep -vE "^(device copy|Llama)" "$work/$name.log" | cut -c1-240 | tail -n 8
    keep
}
step_bench() {
    bench bench 160 --contexts 4096 --weights bf16 --policies sink-4bit,4bit-plain \
        --rounds 2 --budget 100
}
step_long() {
    bench long 240 --contexts 131072 --weights bf16 --policies 4bit --rounds 1
}
step_bench4k() {
    bench bench4k 120 --contexts 4096 --weights bf16 --policies full,sink-window --rounds 2 \
        --budget 60
}
step_q4() {
    bench q4 90 --contexts 4096 --weights q4 --policies 4bit --rounds 2 --budget 40
}
# Plain keys' product is transpose=True, which MLX's fast CUDA kernels take; KIVI's is not.
step_plain() {
    bench plain 200 --contexts 32768,4096 --weights bf16 --policies 4bit-plain,4bit \
        --rounds 2 --budget 140
}

# An evicting sink cache prefills 64 tokens per call (the CPU's best, SINK_PREFILL_CHUNK),
# each call reading every weight once; longer chunks cost S extra keys per query and token.
# One process for the three sizes: one model build, each size's kernels warmed untimed.
step_sinkchunk() {
    bench sinkchunk 150 --contexts 32768 --weights bf16 --policies sink-window --rounds 1 \
        --sink-chunk 64,512,256
}

# The GPU-rule tests on the tiny random families (mx.gpu is MLX's default device there).
step_tests() {
    wanted tests 150 || return
    # MLX_ENABLE_TF32=0: the float32 tests bound float32 rounding, as a Mac computes it; by
    # default MLX's CUDA backend may multiply float32 matrices of more than one row in TF32
    # (10-bit mantissas) and single rows in float32 (gemv): docs/gpu.md, fourth run.
    # SIGINT at the limit: pytest still prints its short summary, each failure's message
    MLX_ENABLE_TF32=0 timeout -s INT -k 10 140 "${pytest[@]}" --tb=line -rfE -n 8 \
        tests/test_gpu_rule.py tests/test_gpu_bench.py tests/test_memory_exact.py \
        tests/test_caches_trim_persist.py tests/test_caches_mlx_lm_protocol.py >"$work/pytest.log" 2>&1
    echo "tests exit $? at ${SECONDS} s, $(grep -cE " PASSED " "$work/pytest.log") passed"
    if grep -qE "^(FAILED|ERROR) " "$work/pytest.log"; then
        # --tb=line: each failure's place and message, then the summary naming the tests
        sed -n "/^=* \(FAILURES\|ERRORS\) =*$/,/^=* short test summary info =*$/p" \
            "$work/pytest.log" | grep -v "^=" | cut -c1-300 | head -n 40
        grep -E "^(FAILED|ERROR) " "$work/pytest.log" | cut -c1-300 | head -n 60
    else
        grep -E " (FAILED|ERROR) " "$work/pytest.log" | sed "s/.*\(FAILED\|ERROR\) //" | head -n 60
    fi
    keep
}

for step in $steps; do
    case $step in
    packed | peak | peakfull | bench | long | bench4k | q4 | plain | sinkchunk | tests)
        "step_$step"
        ;;
    *)
        echo "unknown step $step: packed peak peakfull bench long bench4k q4 plain sinkchunk tests"
        ;;
    esac
done
save_kernels
echo "done at ${SECONDS} s"
