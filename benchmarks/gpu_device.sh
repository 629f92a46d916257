#!/usr/bin/env bash
# The device check of docs/gpu.md in one call of the lent GPU machine (15 minutes of
# device time in all): install the carried wheels (once per machine); check decode on
# packed tokens against dense attention on mx.gpu (MLX's quantized kernels); benchmark the
# quantized KV rows and the 4,096 rows again; probe MLX's peak memory under its settings;
# the 4-bit-weight rows; the GPU-rule tests. Steps run in that order while the deadline
# leaves each its limit, so that the call ends before DEADLINE seconds.
#
#   bash benchmarks/gpu_device.sh WHEEL_DIR OUT_DIR [DEADLINE] [STEP...]
#
# STEP names the steps to run (default all): packed bench4k bench32k peak q4 tests. Every
# log and result lands in OUT_DIR; a benchmark cut short keeps the rows it finished.
set -u
wheels=$1
out=$2
deadline=${3:-540}
shift $(($# < 3 ? $# : 3))
steps=${*:-packed bench4k bench32k peak q4 tests}
mkdir -p "$out"
if [ ! -d /tmp/site/mlx ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site "$wheels"/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:. MLXKV_BLAS=reference PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
    --format=csv | tee "$out/device.txt"
python3 -c "import mlx.core as mx; from mlxkv.memory.dtypes import backend; \
print(mx.__version__, mx.default_device(), mx.device_info(), backend())" \
    | tee -a "$out/device.txt" || exit 1

wanted() {  # STEP LIMIT: whether STEP was asked for and its limit fits before the deadline
    case " $steps " in *" $1 "*) ;; *) return 1 ;; esac
    if [ $((SECONDS + $2)) -gt "$deadline" ]; then
        echo "$1 skipped at ${SECONDS} s: its ${2} s would pass the deadline of ${deadline} s"
        return 1
    fi
}

# -v prints each test's result as it ends, so a run stopped at its limit still names them.
pytest=(python3 -m pytest -v -m "not slow" -p no:cacheprovider --timeout 60)
if wanted packed 60; then
    timeout 60 "${pytest[@]}" --tb=short tests/test_packed_attention.py >"$out/packed.log" 2>&1
    echo "packed attention exit $? at ${SECONDS} s"
    grep -E "PASSED|FAILED|ERROR|assert" "$out/packed.log" | head -n 12
fi

bench() {  # NAME TIMEOUT ARGS...
    local name=$1 limit=$2
    shift 2
    wanted "$name" "$limit" || return
    timeout "$limit" python3 benchmarks/gpu_bench.py "$@" --out "$out/$name" \
        2>"$out/$name.log" >/dev/null
    echo "$name exit $? at ${SECONDS} s"
    tail -n 8 "$out/$name.log"
}
bench bench4k 170 --contexts 4096 --weights bf16 --policies 4bit,8bit,sink-4bit,full,sink-window \
    --rounds 2 --budget 110
bench bench32k 100 --contexts 32768 --weights bf16 --policies 4bit,8bit,sink-4bit \
    --rounds 2 --budget 45

# One process per setting: MLX reads these when it starts. All at 32,768 in bfloat16.
peak() {  # ARGS... (MLX's settings in the environment)
    wanted peak 45 || return
    timeout 45 python3 benchmarks/gpu_peak.py --context 32768 "$@" >>"$out/peak.jsonl" \
        2>>"$out/peak.log"
    echo "peak $* ${MLX_MAX_OPS_PER_BUFFER:+(smaller graphs) }exit $? at ${SECONDS} s"
}
peak --policy full
peak --policy full --side mlx-lm
peak --policy full --presize
MLX_MAX_OPS_PER_BUFFER=20 MLX_MAX_MB_PER_BUFFER=100 peak --policy full
peak --policy 4bit
MLX_MAX_OPS_PER_BUFFER=20 MLX_MAX_MB_PER_BUFFER=100 peak --policy 4bit

bench q4 90 --contexts 4096 --weights q4 --policies full,4bit --rounds 2 --budget 40

# The GPU-rule tests on the tiny random families (mx.gpu is MLX's default device there).
if wanted tests 60; then
    timeout 60 "${pytest[@]}" --tb=no -n 8 tests/test_gpu_rule.py tests/test_gpu_bench.py \
        tests/test_memory_exact.py tests/test_caches_trim_persist.py \
        tests/test_caches_mlx_lm_protocol.py >"$out/pytest.log" 2>&1
    echo "pytest exit $? at ${SECONDS} s"
    grep -cE " PASSED " "$out/pytest.log"
    grep -E " FAILED | ERROR " "$out/pytest.log" | sed 's/.*\(FAILED\|ERROR\) //' | head -n 40
fi
echo "done at ${SECONDS} s"
