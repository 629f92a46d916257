"""Apply a KVPolicy to any mlx-lm model: decide, per layer, which cache to build.

We start from what the runtime builds (``model.make_cache()`` when defined, else one
``KVCache`` per layer; mlx-lm's ``make_prompt_cache`` ignores ``max_kv_size`` in the first
case, we do not). Only caches that grow with the sequence (exactly ``KVCache``) get the
policy; rotating (already windowed) caches, chunked caches, SSM / linear-attention states
and composite ``CacheList`` s are left as the model made them. Everything a policy cannot
honour is refused up front with a one-line :class:`PolicyError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, KVCache

from mlxkv.caches.attention import route_attention
from mlxkv.caches.full import FullKVCache
from mlxkv.caches.kivi import KiviKVCache
from mlxkv.caches.rotation import (
    Identity,
    NotRepositionable,
    Rotation,
    is_rope_module,
    rotation_of,
)
from mlxkv.caches.streaming import QuantizedStreamingKVCache, StreamingKVCache
from mlxkv.errors import one_line
from mlxkv.memory.probe import has_learned_sinks, is_mla
from mlxkv.policy import KVPolicy, PolicyError, check_layers, uses_kivi


@dataclass
class LayerInfo:
    rotation: Rotation | Identity | None = None
    why_not: str | None = None  # why the rotation cannot be shifted
    mla: bool = False
    learned_sinks: bool = False
    head_dims: tuple = ()


@dataclass
class PolicyPlan:
    """What ``make_caches`` will do: which cache indices get the policy."""

    policy: KVPolicy
    growing: list[int] = field(default_factory=list)
    untouched: dict[int, str] = field(default_factory=dict)  # index -> cache class
    layers: dict[int, LayerInfo] = field(default_factory=dict)

    def describe(self) -> str:
        kinds = sorted(set(self.untouched.values()))
        extra = f"; left as built: {', '.join(kinds)}" if kinds else ""
        return f"{self.policy.describe()} on {len(self.growing)} layers{extra}"


def model_name(model) -> str:
    return str(getattr(model, "model_type", None) or type(model).__module__.split(".")[-1])


def base_caches(model) -> list:
    """The caches the model itself would use (no policy)."""
    if hasattr(model, "make_cache"):
        return list(model.make_cache())
    return [KVCache() for _ in model.layers]


def _is_growing(c) -> bool:
    return type(c) is KVCache


def _layer_info(layer: nn.Module, index: int) -> LayerInfo:
    info = LayerInfo()
    ropes, dims = [], []
    nope = False
    for _, m in layer.named_modules():
        info.mla = info.mla or is_mla(m)
        info.learned_sinks = info.learned_sinks or has_learned_sinks(m)
        if getattr(m, "use_rope", 1) in (False, 0) or type(m).__name__ == "NoPE":
            nope = True  # llama4/exaone use_rope flags, smollm3's NoPE stand-in
        hd = getattr(m, "head_dim", None)
        if isinstance(hd, int):
            dims.append(hd)
            vd = getattr(m, "v_head_dim", None)
            if isinstance(vd, int):
                dims.append(vd)
        if is_rope_module(m):
            ropes.append(m)
    info.head_dims = tuple(sorted(set(dims)))
    if nope and not ropes:
        info.rotation = Identity()
        return info
    if not ropes:
        info.why_not = f"no RoPE module found in layer {index}"
        return info
    try:
        rots = [rotation_of(r) for r in ropes]
    except NotRepositionable as e:
        info.why_not = str(e)
        return info
    if any(not r.same_as(rots[0]) for r in rots[1:]):
        info.why_not = f"layer {index} has several different RoPEs"
        return info
    info.rotation = rots[0]
    return info


def _infos(model, n_caches: int) -> dict[int, LayerInfo]:
    layers = list(getattr(model, "layers", []))
    infos = [_layer_info(layer, i) for i, layer in enumerate(layers)]
    if len(infos) == n_caches:
        return dict(enumerate(infos))
    # Caches and layers do not pair up one to one: only a model-wide rotation is safe.
    merged = LayerInfo(
        mla=any(i.mla for i in infos),
        learned_sinks=any(i.learned_sinks for i in infos),
        head_dims=tuple(sorted({d for i in infos for d in i.head_dims})),
    )
    rots = [i.rotation for i in infos if i.rotation is not None]
    if infos and len(rots) == len(infos) and all(r.same_as(rots[0]) for r in rots):
        merged.rotation = rots[0]
    else:
        merged.why_not = "its layers do not map one to one onto its caches"
    return {i: merged for i in range(n_caches)}


def plan_policy(
    model, policy: KVPolicy, caches: list | None = None, head_dims: tuple | None = None
) -> PolicyPlan:
    """Check ``policy`` against ``model``; raise :class:`PolicyError` if it cannot be honoured.

    ``head_dims``: the growing caches' key and value widths, as :func:`cache_head_dims`
    reads them (default: the attention modules' ``head_dim`` attributes, which some
    mlx-lm models do not keep)."""
    caches = base_caches(model) if caches is None else caches
    name = model_name(model)
    plan = PolicyPlan(policy)
    infos = _infos(model, len(caches))
    for i, c in enumerate(caches):
        if _is_growing(c):
            plan.growing.append(i)
            plan.layers[i] = infos[i]
        else:
            plan.untouched[i] = type(c).__name__
    growing = [plan.layers[i] for i in plan.growing]
    check_layers(
        name,
        policy,
        growing=bool(growing),
        composite=any(isinstance(c, CacheList) for c in caches),
        mla=any(info.mla for info in growing),
        learned_sinks=any(info.learned_sinks for info in growing),
        head_dims=head_dims
        if head_dims is not None
        else tuple(sorted({d for info in growing for d in info.head_dims})),
    )
    if policy.sinks and policy.window is not None:
        for info in growing:
            if info.rotation is None:
                raise PolicyError(
                    f"{name}: cannot re-position attention sinks: {info.why_not}; "
                    "use --kv-sinks 0 for a plain window"
                )
    return plan


def check_policy(model, policy: KVPolicy) -> PolicyPlan:
    """Raise :class:`PolicyError` before any generation if ``model`` cannot honour ``policy``.

    Past the static checks of :func:`plan_policy`, the policy's caches are traced through
    the model (:func:`_dry_run`): some mlx-lm attention code reads the cache in ways only a
    plain ``KVCache`` supports, and that should fail here, not mid-answer.
    """
    if policy.window is None and policy.bits is None:
        return plan_policy(model, policy)
    plan = plan_policy(model, policy, head_dims=cache_head_dims(model))
    name = model_name(model)
    # Name the flag to drop: try the window alone first when both are asked for.
    parts = [KVPolicy(window=policy.window, sinks=policy.sinks)] if policy.bits else []
    for part in [*parts, policy]:
        flag = "--kv-bits" if part.bits is not None else "--kv-window"
        try:
            _dry_run(model, part)
        except PolicyError as e:
            raise PolicyError(f"{name}: {e}") from None
        except Exception as e:
            # nanobind's TypeError goes on to list signatures; the first sentence says it.
            why = one_line(e).split(" The following argument types")[0]
            raise PolicyError(
                f"{name}: mlx-lm's attention for this model cannot use a {flag} cache "
                f"({why}); drop {flag}"
            ) from None
    return plan


def cache_head_dims(model) -> tuple[int, ...]:
    """The key and value widths the model's growing caches store, read off the shapes of
    a lazy one-token step (nothing is computed), as the plan's probe reads them."""
    caches = base_caches(model)
    model(mx.array([[0]]), cache=caches)
    dims = set()
    for c in caches:
        if _is_growing(c) and c.keys is not None:
            dims |= {c.keys.shape[-1], c.values.shape[-1]}
    return tuple(sorted(dims))


def _dry_run(model, policy: KVPolicy) -> None:
    """Push a 2-token prefill and a decode step through ``model`` with the policy's caches,
    and for a window a prefill chunk that evicts (through a small window of that kind).

    MLX is lazy and nothing here is evaluated, so this builds a graph and computes (almost)
    nothing. Both steps are needed: quantized caches hand mlx-lm quantized keys only at
    decode (prefill takes the dense path); an evicting chunk is the one update whose
    output is not the kept tokens in order.
    """
    caches = make_caches(model, policy)
    model(mx.array([[0, 0]]), cache=caches)
    model(mx.array([[0]]), cache=caches)
    if policy.window is not None:
        small = replace(policy, window=policy.sinks + 1)
        model(mx.zeros((1, small.sinks + 3), mx.int32), cache=make_caches(model, small))


def cache_for(
    policy: KVPolicy,
    rotation=None,
    mla: bool = False,
    rebase_every: int | None = None,
    reserve: int = 0,
):
    """One growing layer's cache under ``policy``; ``reserve``: tokens a bounded cache can
    still trim exactly after it has evicted (speculative decoding rewinds that many)."""
    if mla:  # positions live in the "values" (decoupled RoPE key): never rotate keys
        rotation = None
    if uses_kivi(policy):
        if reserve:
            raise PolicyError(
                "KIVI keys cannot keep an undo log (a quantized group cannot be rewound); "
                "use key_scheme='rotated' for speculative decoding"
            )
        return KiviKVCache.for_policy(policy, rotation, rebase_every)
    if policy.bits is not None:
        return QuantizedStreamingKVCache.for_policy(policy, rotation, rebase_every, reserve)
    if policy.window is None:
        return FullKVCache()
    return StreamingKVCache(policy.window, policy.sinks, rotation, rebase_every, reserve=reserve)


def _reads_other_layers_caches(model) -> bool:
    """KV-shared models (gemma3n, afm7): some layers attend over another layer's cache,
    read with ``keys_and_values()``."""
    return any(
        getattr(m, "is_kv_shared_layer", False) or getattr(m, "kv_reuse_layers", None)
        for m in model.modules()
    )


def make_caches(
    model, policy: KVPolicy, *, rebase_every: int | None = None, reserve: int = 0
) -> list:
    """Per-layer caches for ``model`` under ``policy`` (see the module docstring).

    ``reserve`` > 0 gives bounded caches an undo log of that many tokens, so that a trim
    after eviction stays exact (mlx-lm's speculative decoding rewinds rejected drafts)."""
    caches = base_caches(model)
    plan = plan_policy(model, policy, caches)
    shared = _reads_other_layers_caches(model)
    for i in plan.growing:
        info = plan.layers[i]
        caches[i] = cache_for(policy, info.rotation, info.mla, rebase_every, reserve)
        if shared and isinstance(caches[i], KiviKVCache):
            caches[i].shared = True
    # Policy caches compute their own attention (quantized ones need to; float ones give
    # mlx-lm's fused call). Routed whatever the policy: mlx-lm's generate may quantize a
    # cache later (``to_quantized``).
    route_attention(model)
    return caches
