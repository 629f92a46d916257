#!/usr/bin/env bash
# The device check of docs/gpu.md in one call of the lent GPU machine (15 minutes of
# device time in all): install the carried wheels, run the benchmark at 4k and 32k (both
# weight formats, every policy) and at 128k (bfloat16, 4-bit KV), then the GPU-rule tests
# on mx.gpu, each within a time budget so that the call ends inside 7 minutes.
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

timeout 200 python3 benchmarks/gpu_bench.py --contexts 4096,32768 --rounds 1 --budget 140 \
    --out "$out/gpu-4k-32k" 2>"$out/gpu-4k-32k.log" >/dev/null
echo "4k/32k exit $?"
tail -n 25 "$out/gpu-4k-32k.log"
timeout 100 python3 benchmarks/gpu_bench.py --contexts 131072 --weights bf16 --policies 4bit \
    --rounds 1 --budget 60 --out "$out/gpu-128k" 2>"$out/gpu-128k.log" >/dev/null
echo "128k exit $?"
tail -n 8 "$out/gpu-128k.log"

# The GPU-rule tests on the tiny random families (mx.gpu is MLX's default device there),
# the packed-attention check against dense attention first: it checks MLX's GPU kernels.
# -v prints each test's result as it ends, so a run stopped at its limit still names them.
timeout 70 python3 -m pytest -v --tb=no -m "not slow" -n 8 -p no:cacheprovider --timeout 60 \
    tests/test_packed_attention.py tests/test_gpu_rule.py tests/test_gpu_bench.py tests/test_memory_exact.py \
    tests/test_caches_trim_persist.py tests/test_caches_mlx_lm_protocol.py \
    >"$out/pytest.log" 2>&1
echo "pytest exit $?"
grep -cE " PASSED " "$out/pytest.log"
grep -E " FAILED | ERROR " "$out/pytest.log" | sed 's/.*\(FAILED\|ERROR\) //' | head -n 40
