"""Sink decode speed against mlx-lm's RotatingKVCache(1024, keep=4), in one process.

    STEPS=16 ROUNDS=3 python benchmarks/sink_decode.py TEXT_FILE

Every cache is filled with the same 1,088 tokens of the text (evicting: sinks 4 + window
1020), then the caches take turns decoding STEPS greedy tokens with mlx-lm's generate_step,
ROUNDS rounds (order reversed every other round). Caches: mlx-lm's RotatingKVCache; mlxkv's
sink 4 + window 1020; the same with the sinks rotated by one rope call per step (what the
cache did before ``rotation.ShiftsAhead``); sink 4 + window 1020 at 4 bits (the --kv-bits
default). Prints decode tok/s per round, medians and the median ratio to mlx-lm.
"""

import os
import statistics
import sys
import time

from mlxkv.backend import setup_blas

setup_blas()  # route MLX to OpenBLAS before anything imports MLX

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import RotatingKVCache  # noqa: E402

from mlxkv.bench.corpus import token_stream  # noqa: E402
from mlxkv.caches import make_caches  # noqa: E402
from mlxkv.models.loader import load  # noqa: E402
from mlxkv.models.resolve import resolve  # noqa: E402
from mlxkv.policy import KVPolicy  # noqa: E402

loaded = load(resolve(None).path)
model = loaded.model
ids, _ = token_stream(loaded.tokenizer, open(sys.argv[1], encoding="utf-8").read(), 1100)


class PerStep:  # the code before ShiftsAhead: one rope call per step
    def get(self, rot, x, d):
        return rot.shift(x, d)

    def clear(self):
        pass


def old():
    cs = make_caches(model, KVPolicy(window=1020, sinks=4))
    for c in cs:
        c._ahead = PerStep()
    return cs


variants = {
    "lm-rot": lambda: [RotatingKVCache(1024, keep=4) for _ in model.layers],
    "sink": lambda: make_caches(model, KVPolicy(window=1020, sinks=4)),
    "sink-before": old,
    "sink-4bit": lambda: make_caches(model, KVPolicy(window=1020, sinks=4, bits=4)),
}
caches = {}
for k, f in variants.items():
    c = f()
    for a, b in [(0, 512), (512, 1024), (1024, 1088)]:
        model(mx.array(ids[a:b])[None], cache=c)
        mx.eval([x.state for x in c])
    caches[k] = c
    if k == "sink-before":
        assert all(isinstance(x._ahead, PerStep) for x in c)
N = int(os.environ.get("STEPS", "16"))
res = {k: [] for k in variants}
loads = []
for r in range(int(os.environ.get("ROUNDS", "3"))):
    order = list(variants) if r % 2 == 0 else list(variants)[::-1]
    for k in order:
        st = []
        for _y, _ in generate_step(
            mx.array([ids[-1]]), model, max_tokens=N, prompt_cache=caches[k]
        ):
            st.append(time.perf_counter())
        res[k].append((len(st) - 1) / (st[-1] - st[0]))
        loads.append(os.getloadavg()[0])
    print("round", r, {k: round(v[-1], 2) for k, v in res.items()}, "load", loads[-1], flush=True)
print("load median", statistics.median(loads), "min", min(loads), "max", max(loads))
for k, v in res.items():
    print(
        k,
        round(statistics.median(v), 3),
        [round(x, 2) for x in v],
        "ratio vs lm-rot",
        round(statistics.median(a / b for a, b in zip(v, res["lm-rot"], strict=True)), 3),
    )
