"""config.json -> Layout, by asking mlx-lm what it builds.

We do not re-derive each architecture's cache: we instantiate mlx-lm's own model class
from the config, call its ``make_cache`` (``make_prompt_cache``), and push two tokens
through it. MLX is lazy, so nothing is computed or allocated: the cache objects end up
holding *unevaluated* arrays whose shapes and dtypes are exactly what the runtime would
store (heads, head dims, MLA latent, SSM conv/state sizes...). Weights are swapped for
zero-stride broadcasts first, so even a model that forces an eval mid-forward (dbrx's
router does) touches a few bytes, not the checkpoint's size.

The probe imports ``mlx_lm.models.<name>`` the ordinary way. ``mlx_lm/__init__`` imports
transformers (about 2 s on a Mac), paid once per config: ``mlxkv.memory.store`` keeps the
layout on disk, so a repeated ``plan`` imports neither.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib
import importlib.util
import sys
from dataclasses import replace
from functools import cache
from pathlib import Path

from mlxkv.errors import one_line
from mlxkv.memory.config import BadInput, text_view, validate
from mlxkv.memory.layout import CacheSpec, LayerSpec, Layout, ModelFacts
from mlxkv.policy import SUPPORTED_GROUP_SIZES

PROBE_DTYPE = "float16"  # distinct from float32, so states the runtime pins to float32 show up
_HELPERS = {
    "__init__",
    "base",
    "cache",
    "activations",
    "rope_utils",
    "switch_layers",
    "pipeline",
    "ssm",
    "gated_delta",
    "mla",
    "bitlinear_layers",
}
# Which kind of fixed state an ArraysCache holds, per mlx-lm module (for display only).
_STATE_ROLE = {
    "mamba": "ssm",
    "mamba2": "ssm",
    "falcon_h1": "ssm",
    "granitemoehybrid": "ssm",
    "nemotron_h": "ssm",
    "jamba": "ssm",
    "plamo2": "ssm",
    "qwen3_next": "linear",
    "qwen3_5": "linear",
    "qwen3_5_moe": "linear",
    "kimi_linear": "linear",
    "kimi_k3": "linear",
    "olmo_hybrid": "linear",
    "bailing_moe_v3": "linear",
    "bailing_moe_linear": "linear",
    "bailing_hybrid": "linear",
    "lfm2": "conv",
    "lfm2_moe": "conv",
    "baichuan_m1": "conv",
    "recurrent_gemma": "recurrent",
    "rwkv7": "recurrent",
}


def _models_dir() -> Path:
    spec = importlib.util.find_spec("mlx_lm")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise BadInput("mlx-lm is not installed; install mlx-lm to plan a model")
    return Path(list(spec.submodule_search_locations)[0]) / "models"


@cache
def _remappings() -> tuple[dict, dict]:
    """mlx-lm's model_type remapping tables, read from its source (no transformers import)."""
    utils = sys.modules.get("mlx_lm.utils")
    if utils is not None:
        return dict(utils.MODEL_REMAPPING), dict(utils.MODEL_ARCHITECTURE_REMAPPING)
    tables = {"MODEL_REMAPPING": {}, "MODEL_ARCHITECTURE_REMAPPING": {}}
    tree = ast.parse((_models_dir().parent / "utils.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            name = getattr(node.targets[0], "id", None)
            if name in tables:
                tables[name] = ast.literal_eval(node.value)
    return tables["MODEL_REMAPPING"], tables["MODEL_ARCHITECTURE_REMAPPING"]


@cache
def supported_model_types() -> tuple[str, ...]:
    files = {p.stem for p in _models_dir().glob("*.py")} - _HELPERS
    return tuple(sorted(files | set(_remappings()[0])))


def module_name(config: dict) -> str:
    """The mlx-lm module for a config, as mlx_lm.utils._get_classes picks it."""
    model_type = validate(config)
    remap, arch_remap = _remappings()
    archs = config.get("architectures") or ()
    if isinstance(archs, str):
        archs = (archs,)
    name = None
    for arch in archs:
        name = arch_remap.get((model_type, arch))
        if name:
            break
    name = name or remap.get(model_type, model_type)
    if name not in {p.stem for p in _models_dir().glob("*.py")} - _HELPERS:
        import difflib

        types = supported_model_types()
        near = difflib.get_close_matches(str(model_type), types, n=3)
        hint = f" (did you mean {' or '.join(map(repr, near))}?)" if near else ""
        raise BadInput(
            f"unknown model_type {str(model_type)[:60]!r}{hint}: the installed mlx-lm runs "
            f"{len(types)} types, not this one; fix config.json or upgrade mlx-lm"
        )
    return name


def _check_quantization(config: dict) -> None:
    q = config.get("quantization")
    if isinstance(q, dict) and q.get("mode", "affine") == "affine":
        group = q.get("group_size")
        if group not in SUPPORTED_GROUP_SIZES:  # no layer would divide by it: planned unpacked
            raise BadInput(
                f"quantization.group_size {group!r} is not one MLX packs weights in (32, 64, "
                "128); fix config.json"
            )


def _load_tied(model, config: dict, view: dict) -> None:
    """Some mlx-lm models (Gemma 3, RecurrentGemma) build an ``lm_head`` whatever the config
    says and drop it in ``sanitize`` when the checkpoint has none, as the published ones
    (tied embeddings, the config's default) do not. Load a checkpoint without a head the
    same way, unless the config says the embeddings are not tied: the embedding table is
    then counted once, as it is held."""
    from mlx.utils import tree_flatten

    if False in (config.get("tie_word_embeddings"), view.get("tie_word_embeddings")):
        return
    params = dict(tree_flatten(model.parameters()))
    checkpoint = {k: v for k, v in params.items() if ".lm_head." not in f".{k}"}
    if len(checkpoint) == len(params) or not hasattr(model, "sanitize"):
        return
    try:
        model.sanitize(checkpoint)
    except Exception:  # a sanitize that needs more of a real checkpoint: the head stays
        pass


def _quantize(nn, model, config: dict) -> bool:
    """Quantize the (lazy) model the way the checkpoint is, so parameter bytes are packed.

    The choices of ``mlx_lm.utils.quantize_model``, read back from what it writes: a layer
    listed in ``quantization`` (a dict of bits/group size/mode, as mixed-bit recipes record
    every layer, or false) is quantized so; any other layer is quantized with the global
    bits when it can be (``to_quantized``, last dim divisible by the global group size) and
    the model's own ``quant_predicate`` (which keeps e.g. MoE routers unquantized, unrecorded
    in the config) does not decline it."""
    q = config.get("quantization")
    if isinstance(q, dict):
        per_path = {k: v for k, v in q.items() if isinstance(v, (dict, bool))}
        own = getattr(model, "quant_predicate", None)

        def predicate(path, m):
            if path in per_path:
                return per_path[path]
            if not hasattr(m, "to_quantized") or m.weight.shape[-1] % q["group_size"]:
                return False
            return own(path, m) if own is not None else True

        nn.quantize(
            model,
            group_size=q["group_size"],
            bits=q["bits"],
            mode=q.get("mode", "affine"),
            class_predicate=predicate,
        )
        return True
    qc = text_view(config).get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") in ("mxfp4", "mxfp8"):
        # gpt-oss style: everything but the listed modules is packed.
        skip = [s.replace("model.", "", 1) for s in qc.get("modules_to_not_convert") or ()]
        bits = 4 if qc["quant_method"] == "mxfp4" else 8

        def mx_predicate(path, m):
            if not hasattr(m, "to_quantized") or m.weight.shape[-1] % 32:
                return False
            return not any(fnmatch.fnmatch(path.replace("model.", "", 1), s) for s in skip)

        nn.quantize(
            model, group_size=32, bits=bits, mode=qc["quant_method"], class_predicate=mx_predicate
        )
        return True
    return False


def _describe(c, args, module: str, dtype_name) -> CacheSpec:
    cls = next(
        (k.__name__ for k in type(c).__mro__ if k.__module__.startswith("mlx_lm.models.cache")),
        type(c).__name__,
    )
    if cls == "ArraysCache":
        arrays = []
        for a in c.cache:
            if a is None:
                continue
            if a.shape[0] != 1:
                raise BadInput(f"{module}: state array without a batch axis {a.shape}")
            dt = dtype_name(a.dtype)
            arrays.append((tuple(a.shape[1:]), None if dt == PROBE_DTYPE else dt))
        return CacheSpec("ArraysCache", _STATE_ROLE.get(module, "state"), arrays=tuple(arrays))
    if cls not in ("KVCache", "RotatingKVCache", "ChunkedKVCache", "QuantizedKVCache"):
        raise BadInput(f"mlx-lm model '{module}' builds a {cls} cache, which mlxkv cannot size")
    if c.keys is None:
        return CacheSpec("unused", "unused")
    if cls == "QuantizedKVCache":
        k, v = c.keys[1], c.values[1]  # scales: (B, H, T, dim // group_size)
        kd, vd = k.shape[-1] * c.group_size, v.shape[-1] * c.group_size
        dt = dtype_name(k.dtype)
        return CacheSpec(
            cls,
            "attention",
            k.shape[1],
            kd,
            vd,
            None if dt == PROBE_DTYPE else dt,
            bits=c.bits,
            group_size=c.group_size,
        )
    k, v = c.keys, c.values
    if k.ndim != 4 or k.shape[0] != 1 or k.shape[:3] != v.shape[:3]:
        raise BadInput(f"mlx-lm model '{module}' stores keys as {k.shape}; mlxkv cannot size it")
    dt = dtype_name(k.dtype)
    heads, kd, vd = k.shape[1], k.shape[3], v.shape[3]
    role, window = "attention", None
    if cls == "RotatingKVCache":
        role, window = "sliding", c.max_size
    elif cls == "ChunkedKVCache":
        role, window = "chunked", c.chunk_size
    elif heads == 1 and kd == _arg(args, "kv_lora_rank"):
        role = "mla"
    return CacheSpec(
        cls,
        role,
        heads,
        kd,
        vd,
        None if dt == PROBE_DTYPE else dt,
        window=window,
        keep=getattr(c, "keep", 0) if cls == "RotatingKVCache" else 0,
    )


def _arg(args, name: str):
    """A ModelArgs field, looking into a nested text_config too."""
    for a in (args, getattr(args, "text_config", None)):
        v = a.get(name) if isinstance(a, dict) else getattr(a, name, None)
        if v is not None:
            return v
    return None


def _declared_window(view: dict) -> int | None:
    for key in ("sliding_window", "sliding_window_size", "attention_window_size"):
        v = view.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def is_mla(module) -> bool:
    """An attention module with a low-rank (MLA) key/value projection: its keys carry the
    RoPE part apart, so they are neither re-positioned nor quantized."""
    return bool(getattr(module, "kv_lora_rank", None))


def has_learned_sinks(module) -> bool:
    """An attention module with learned sink logits (gpt-oss), which mlx-lm's quantized
    attention does not take."""
    import mlx.core as mx

    return isinstance(getattr(module, "sinks", None), mx.array)


def probe(config: dict) -> Layout:
    """Build mlx-lm's model for ``config`` lazily and read off every cache it makes."""
    module = module_name(config)
    view = text_view(config)
    config = dict(config)
    # As mlx_lm.utils.load_model does for multimodal configs.
    if "quantization_config" not in config and "quantization_config" in view:
        config["quantization_config"] = view["quantization_config"]
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map

    try:
        arch = importlib.import_module(f"mlx_lm.models.{module}")
        cache_mod = importlib.import_module("mlx_lm.models.cache")
    except (Exception, SystemExit) as e:  # olmo.py calls sys.exit without ai2-olmo
        raise BadInput(f"mlx-lm cannot import model '{module}': {one_line(e)}") from None
    _check_quantization(config)
    try:
        args = arch.ModelArgs.from_dict(config)
        model = arch.Model(args)
        _load_tied(model, config, view)
        dense_params = sum(p.size for _, p in tree_flatten(model.parameters()))
        quantized = _quantize(nn, model, config)
        model.eval()
        modules = [m for _, m in model.named_modules()]
        mla, learned_sinks = any(map(is_mla, modules)), any(map(has_learned_sinks, modules))
    except Exception as e:
        raise BadInput(
            f"config.json does not describe a valid '{module}' model for mlx-lm: {one_line(e)}"
        ) from None

    float_params = fixed_bytes = 0
    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            float_params += p.size
        else:
            fixed_bytes += p.nbytes

    probe_dt = getattr(mx, PROBE_DTYPE)

    def zero(p):
        dt = probe_dt if mx.issubdtype(p.dtype, mx.floating) else p.dtype
        return mx.broadcast_to(mx.zeros((), dtype=dt), p.shape)

    model.update(tree_map(zero, model.parameters()))

    def dtype_name(dt) -> str:
        return str(dt).rsplit(".", 1)[-1]

    try:
        caches = cache_mod.make_prompt_cache(model)
        model(mx.array([[0, 0]]), cache=caches)
        model(mx.array([[0]]), cache=caches)
    except Exception as e:
        raise BadInput(f"mlx-lm's '{module}' model fails on this config: {one_line(e)}") from None

    layers = []
    for i, c in enumerate(caches):
        if type(c).__name__ == "CacheList":
            parts = tuple(
                replace(_describe(p, args, module, dtype_name), in_list=True) for p in c.caches
            )
        else:
            parts = (_describe(c, args, module, dtype_name),)
        layers.append(LayerSpec(i, parts))

    facts = ModelFacts(
        hidden_size=_int(view, "hidden_size", "d_model", "n_embd"),
        vocab_size=_int(view, "vocab_size"),
        num_attention_heads=_int(view, "num_attention_heads", "n_head"),
        intermediate_size=_int(view, "intermediate_size", "moe_intermediate_size"),
        max_position_embeddings=_int(view, "max_position_embeddings") or None,
        declared_window=_declared_window(view),
        dense_params=dense_params,
        float_params=float_params,
        fixed_param_bytes=fixed_bytes,
        quantized=quantized,
        mla=mla,
        learned_sinks=learned_sinks,
    )
    return Layout(config["model_type"], module, tuple(layers), facts)


def _int(view: dict, *keys: str) -> int:
    for k in keys:
        v = view.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return 0
