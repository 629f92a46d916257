#!/usr/bin/env bash
# The device check of docs/gpu.md in one call of the lent GPU machine (15 minutes of
# device time in all): install the carried wheels; check decode on packed tokens against
# dense attention on mx.gpu (MLX's quantized kernels); benchmark the rows not yet measured
# (4-bit, 8-bit and sink + 4-bit KV at 4k and 32k, then 4-bit weights at 4k); then the
# GPU-rule tests on mx.gpu, each step within a time budget so that the call ends inside
# 7 minutes.
#
#   bash benchmarks/gpu_device.sh WHEEL_DIR OUT_DIR
#
# Every log and result lands in OUT_DIR; a benchmark cut short keeps the rows it finished.
set -u
wheels=$1
out=$2
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "$wheels"/*.whl || exit 1
export PYTHONPATH=/tmp/site:. MLXKV_BLAS=reference PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
    --format=csv | tee "$out/device.txt"
python3 -c "import mlx.core as mx; from mlxkv.memory.dtypes import backend; \
print(mx.__version__, mx.default_device(), mx.device_info(), backend())" \
    | tee -a "$out/device.txt" || exit 1

# -v prints each test's result as it ends, so a run stopped at its limit still names them.
pytest=(python3 -m pytest -v -m "not slow" -p no:cacheprovider --timeout 60)
timeout 60 "${pytest[@]}" --tb=short tests/test_packed_attention.py >"$out/packed.log" 2>&1
echo "packed attention exit $?"
grep -E "PASSED|FAILED|ERROR|assert" "$out/packed.log" | head -n 12

bench() {  # NAME TIMEOUT ARGS...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" python3 benchmarks/gpu_bench.py "$@" --out "$out/$name" \
        2>"$out/$name.log" >/dev/null
    echo "$name exit $?"
    tail -n 12 "$out/$name.log"
}
bench gpu-kv-quant 220 --contexts 4096,32768 --weights bf16 --policies 4bit,8bit,sink-4bit \
    --rounds 2 --budget 160
bench gpu-q4 100 --contexts 4096 --weights q4 --policies full,4bit --rounds 2 --budget 60

# The GPU-rule tests on the tiny random families (mx.gpu is MLX's default device there).
timeout 70 "${pytest[@]}" --tb=no -n 8 tests/test_gpu_rule.py tests/test_gpu_bench.py \
    tests/test_memory_exact.py tests/test_caches_trim_persist.py \
    tests/test_caches_mlx_lm_protocol.py >"$out/pytest.log" 2>&1
echo "pytest exit $?"
grep -cE " PASSED " "$out/pytest.log"
grep -E " FAILED | ERROR " "$out/pytest.log" | sed 's/.*\(FAILED\|ERROR\) //' | head -n 40
