"""Predicted KV bytes == what MLX holds, to the byte, for every family in tiny_families.json.

Each family is mlx-lm's own model class built from a tiny random float32 config
(tests/data/configs/tiny_families.json, derived from mlx-lm's tests). We run chunked
prefill and decode with real arrays and, after every model call, compare

* ``allocated`` with the sum of the caches' ``nbytes``, and
* ``logical`` with the kept-token formula computed here from the cache objects,

for mlx-lm's own caches (``make_prompt_cache``, runtime "mlx-lm") and for mlxkv's caches
under every policy the model accepts (``mlxkv.caches.make_caches``, runtime "mlxkv"):
full, window, sink+window, 4-bit, 8-bit, sink+window+4-bit.

Families covered (82): Klear, afmoe, apertus, baichuan_m1, bailing_moe, bailing_moe_linear,
cohere, cohere2, deepseek, deepseek_v2, deepseek_v3, deepseek_v32, dots1, ernie4_5,
ernie4_5_moe, exaone, exaone4, exaone_moe, falcon_h1, gemma, gemma2, gemma3_text, gemma3n,
gemma4, glm, glm4, glm4_moe, glm4_moe_lite, gpt2, gpt_neox, gpt_oss, granite, granitemoe,
granitemoehybrid, helium, hunyuan, hunyuan_v1_dense, internlm2, internlm3, iquestloopcoder,
jamba, kimi_linear, kimi_vl, laguna, lfm2, lfm2-vl, lfm2_moe, lille-130m, llama, llama4,
llama4_text, longcat_flash, longcat_flash_ngram, mamba, mamba2, mimo, mimo_v2_flash, minicpm,
minimax, mixtral, nemotron, nemotron_h, olmo2, olmo3, olmoe, phi3, phi3small, pixtral,
plamo2, qwen2, qwen3, qwen3_5, qwen3_5_moe, qwen3_next, qwen3_vl, qwen3_vl_moe,
recurrent_gemma, rwkv7, seed_oss, smollm3, stablelm, starcoder2, telechat3.
(mistral is llama in mlx-lm; falcon_mamba is mamba.) The families the brief names run by
default; the rest are marked slow (``pytest -m slow``).
"""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mlxkv.memory.predictor import KVPredictor  # noqa: E402
from mlxkv.memory.probe import probe  # noqa: E402
from mlxkv.policy import KVPolicy, PolicyError  # noqa: E402
from tests.tiny_models import FAMILIES, build_family  # noqa: E402

CORE = {
    "llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "deepseek_v2",
    "deepseek_v3", "gpt_oss", "cohere2", "olmo2", "starcoder2", "mamba", "mamba2",
    "qwen3_next", "llama4", "falcon_h1", "granitemoehybrid", "nemotron_h",
    "recurrent_gemma", "lfm2", "jamba", "mixtral", "kimi_linear", "deepseek_v32",
    "baichuan_m1", "exaone4", "olmo3", "qwen3_5", "rwkv7", "longcat_flash_ngram",
}  # fmt: skip
POLICIES = [
    KVPolicy(),
    KVPolicy(window=40),
    KVPolicy(window=40, sinks=4),
    KVPolicy(bits=4, group_size=32),
    KVPolicy(bits=8, group_size=32),
    KVPolicy(window=40, sinks=4, bits=4, group_size=32),
    KVPolicy(key_bits=4, value_bits=2, group_size=32),
    KVPolicy(window=40, sinks=4, key_bits=3, value_bits=8, group_size=32, key_scheme="plain"),
]
# (batch, model calls): prompt chunks then 1-token decode steps.
NATIVE_RUNS = [(1, [5, 1, 1]), (2, [3, 130, 130, 1, 1])]  # crosses 256: mlx-lm's history rule
POLICY_RUNS = [(2, [5, 50, 1, 1, 20, 1])]  # crosses the 40-token window mid-chunk


def _row(dim: int, bits: int | None, group_size: int, b: int) -> int:
    if bits is None:
        return dim * b
    return dim * bits // 32 * 4 + 2 * (dim // group_size) * b


def expected_logical(c, policy: KVPolicy, spec, b: int = 4) -> int:
    """Kept tokens x bytes per token, from the cache object itself (+ fixed states).

    ``spec`` (the probed layout entry) only supplies the head dims of a quantized cache.
    """
    name = type(c).__name__
    if name == "CacheList":
        return sum(expected_logical(x, KVPolicy(), spec, b) for x in c.caches)
    if name == "ArraysCache":
        return c.nbytes
    held = c.values if name == "KiviKVCache" else c.keys  # KIVI keys are stored transposed
    if held is None:
        return 0
    if hasattr(c, "kept"):  # mlxkv's caches count the tokens they keep
        k = held[0] if isinstance(held, (tuple, list)) else held
        batch, heads = k.shape[0], k.shape[1]
        row = _row(spec.k_head_dim, policy.key_bits, policy.group_size, b) + _row(
            spec.v_head_dim, policy.value_bits, policy.value_group_size, b
        )
        return c.kept * batch * heads * row
    per_token = (c.keys.nbytes + c.values.nbytes) // c.keys.shape[2]
    kept = {
        "KVCache": c.offset,
        "RotatingKVCache": min(c.offset, getattr(c, "max_size", 0)),
        "ChunkedKVCache": min(c.offset, getattr(c, "chunk_size", 0)),
    }[name]
    return kept * per_token


# Under the GPU rule, as the published checkpoints are: mlx-lm's seed_oss multiplies by
# ``embed_tokens.weight.T`` when the head is tied, which a packed embedding cannot do
# (Seed-OSS-36B does not tie it).
GPU_OVERRIDES = {"seed_oss": {"tie_word_embeddings": False}}


def _build(family: str, rule: str = "float32"):
    """The family's model; under the ``gpu`` rule in bfloat16 with its linear and embedding
    layers packed to 4 bits (group 32) where their width allows, as a GPU runs it."""
    model = build_family(family, **(GPU_OVERRIDES.get(family, {}) if rule == "gpu" else {}))
    model.eval()
    if rule == "gpu":
        import mlx.nn as nn

        def packable(_, m):  # linear, embedding and expert (SwitchLinear) layers
            weight = getattr(m, "weight", None)
            return hasattr(m, "to_quantized") and weight is not None and weight.shape[-1] % 32 == 0

        nn.quantize(model, group_size=32, bits=4, class_predicate=packable)
        model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model, probe(FAMILIES[family])


def _run(model, layout, caches, policy, runtime, batch, calls, kv_dtype="float32"):
    b = 2 if kv_dtype == "bfloat16" else 4
    pred = KVPredictor(layout, policy, batch=batch, kv_dtype=kv_dtype, runtime=runtime)
    assert pred.snapshot().allocated == 0
    for n in calls:
        model(mx.random.randint(0, 100, (batch, n)), cache=caches)
        mx.eval([a for c in caches for _, a in tree_flatten(c.state) if isinstance(a, mx.array)])
        snap = pred.advance(n)
        actual = sum(c.nbytes for c in caches)
        where = f"{runtime} {policy.describe()} batch {batch} after {pred.tokens_seen} tokens"
        assert snap.allocated == actual, where
        logical = sum(
            expected_logical(c, policy, layer.parts[0], b)
            for c, layer in zip(caches, layout.layers, strict=True)
        )
        assert snap.logical == logical, where


def _params():
    for fam in sorted(FAMILIES):
        marks = () if fam in CORE else (pytest.mark.slow,)
        yield pytest.param(fam, marks=marks, id=fam)


@pytest.mark.parametrize("family", list(_params()))
def test_exact_bytes(family):
    from mlxkv.caches import check_policy, make_caches

    model, layout = _build(family)
    for batch, calls in NATIVE_RUNS:
        _run(model, layout, make_prompt_cache(model), KVPolicy(), "mlx-lm", batch, calls)
    for policy in POLICIES:
        try:
            check_policy(model, policy)
        except PolicyError:
            continue  # refused up front (tests/test_caches_build.py covers the refusals)
        for batch, calls in POLICY_RUNS:
            _run(model, layout, make_caches(model, policy), policy, "mlxkv", batch, calls)


# The GPU rule on a few families (GQA, sliding + global layers with learned sinks and
# experts, MLA, SSM; llama runs it on the default model in test_gpu_dtype.py); every other
# family under it: -m slow.
GPU_CORE = {"qwen3", "gpt_oss", "deepseek_v3", "mamba2"}


def _gpu_params():
    for fam in sorted(FAMILIES):
        marks = () if fam in GPU_CORE else (pytest.mark.slow,)
        yield pytest.param(fam, marks=marks, id=fam)


@pytest.mark.parametrize("family", list(_gpu_params()))
def test_exact_bytes_under_the_gpu_rule(family):
    """bfloat16 activations and KV, packed 4-bit weights: the prediction in bfloat16 is
    what MLX holds, to the byte, for mlx-lm's caches and ours."""
    from mlxkv.caches import check_policy, make_caches

    model, layout = _build(family, "gpu")
    batch, calls = NATIVE_RUNS[0]
    _run(model, layout, make_prompt_cache(model), KVPolicy(), "mlx-lm", batch, calls, "bfloat16")
    for policy in POLICIES:
        try:
            check_policy(model, policy)
        except PolicyError:
            continue
        for batch, calls in POLICY_RUNS:
            caches = make_caches(model, policy)
            _run(model, layout, caches, policy, "mlxkv", batch, calls, "bfloat16")
