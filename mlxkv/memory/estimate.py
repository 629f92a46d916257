"""One model, one setting -> everything ``plan`` reports; ``check_fits`` for the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mlxkv.errors import UserError
from mlxkv.memory.budget import Budget, Setting, budget, gib, max_batch, max_context
from mlxkv.memory.config import BadInput, validate
from mlxkv.memory.context import past_trained_context, trained_context
from mlxkv.memory.dtypes import BACKENDS, backend, default_kv_dtype, default_weight_dtype, is_gpu
from mlxkv.memory.layout import Layout
from mlxkv.memory.source import ModelSource, from_path
from mlxkv.memory.system import SystemMemory, system_memory
from mlxkv.memory.weights import Weights, from_hub, from_layout, from_local
from mlxkv.memory.working_set import WiredAdvice, load_wired_limit, wired_advice
from mlxkv.policy import KVPolicy, check_layers

DEFAULT_CONTEXT = 4096


@dataclass
class Estimate:
    name: str
    source: ModelSource
    layout: Layout
    setting: Setting
    budget: Budget
    memory: SystemMemory
    max_context: int | None = None  # None: any context fits (every cache bounded)
    max_batch: int = 0
    notes: list[str] = field(default_factory=list)
    # Notes on the verdict for one host holding the whole model (not for a split over hosts).
    fit_notes: list[str] = field(default_factory=list)
    trained_context: int | None = None  # the model's, from config.json (mlxkv.memory.context)
    weight_bits: int | None = None  # planned as an MLX conversion quantized to these bits
    wired: WiredAdvice | None = None  # the sysctl that makes it fit on this Mac, if any
    load_wired_limit: int | None = None  # what mlxkv wires at load on Metal
    memory_arg: str | None = None  # --memory as given (per-host plans read it again)

    @property
    def past_trained_context(self) -> bool:
        s = self.setting
        return past_trained_context(self.trained_context, s.policy.window, s.context)

    @property
    def config(self) -> dict:
        """The config as planned: with ``--weight-bits``, that of the MLX conversion."""
        if self.weight_bits is None:
            return self.source.config
        return with_weight_bits(self.source.config, self.weight_bits)

    @property
    def runnable(self) -> bool:
        """It fits, and the engine would run it (no context past the trained one)."""
        return self.budget.fits and not self.past_trained_context


def _weights(src: ModelSource, layout: Layout, wdtype: str, dequantize: bool, notes) -> Weights:
    if src.folder is not None:
        w = from_local(src.folder, src.config, wdtype, dequantize)
        if w is not None:
            return w
    if src.repo:
        try:
            return from_hub(src.repo, src.config, wdtype, dequantize)
        except Exception as e:  # hub unreachable: fall back to the config, and say so
            notes.append(f"hub safetensors metadata unavailable ({type(e).__name__})")
    return from_layout(layout.facts, wdtype, dequantize)


def check_policy(layout: Layout, policy: KVPolicy) -> None:
    """The refusals of mlxkv.caches.plan_policy that the layout alone can decide."""
    growing = [p for p in layout.specs() if p.grows]
    check_layers(
        layout.model_type,
        policy,
        growing=bool(growing),
        composite=any(p.in_list for p in layout.specs()),
        mla=layout.facts.mla,
        learned_sinks=layout.facts.learned_sinks,
        head_dims=tuple(sorted({d for p in growing for d in (p.k_head_dim, p.v_head_dim)} - {0})),
    )


def _window_note(layout: Layout, s: Setting) -> str | None:
    """Say what the config's sliding window would save where the runtime ignores it."""
    w = layout.facts.declared_window
    full = [p for p in layout.specs() if p.grows]
    if not w or not full or s.policy.window is not None or s.context <= w:
        return None
    if any(p.cls == "RotatingKVCache" for p in layout.specs()):
        return None  # the runtime already windows the layers the config marks as local
    per_token = sum(p.bytes_per_token(s.kv_dtype) for p in full) * s.batch
    saved = per_token * (s.context - w)
    return (
        f"config.json declares sliding_window={w}, but mlx-lm keeps full caches on "
        f"{len(full)} layers; --kv-window {w} --kv-sinks 0 would save "
        f"{saved / 2**30:.2f} GiB of KV at {s.context} tokens"
    )


def estimate_model(
    src: ModelSource,
    policy: KVPolicy | None = None,
    context: int | None = None,
    batch: int = 1,
    chunk: int = 512,
    kv_dtype: str | None = None,
    memory: str | None = None,
    search: bool = True,
    on: str | None = None,
    weight_bits: int | None = None,
) -> Estimate:
    """``on``: "metal", "cuda" or "cpu" (default: this machine's backend); ``weight_bits``: plan
    the model as ``mlx_lm.convert -q --q-bits b`` (group 64) would store it."""
    from mlxkv.memory.store import layout_for

    policy = policy or KVPolicy()
    validate(src.config)
    on = on or backend()
    if on not in BACKENDS:
        raise BadInput(f"--backend must be one of {', '.join(BACKENDS)}, got '{on}'")
    config = src.config
    if weight_bits is not None:
        config = with_weight_bits(config, weight_bits)
    layout = layout_for(config)
    check_policy(layout, policy)
    wdtype = default_weight_dtype(config, on)
    dequantize = not is_gpu(on)  # mlxkv.models.loader.weight_rule: float32, dequantized
    notes: list[str] = []
    if weight_bits is None:
        weights = _weights(src, layout, wdtype, dequantize, notes)
    else:
        weights = from_layout(layout.facts, wdtype, dequantize)
    kv_dtype = kv_dtype or default_kv_dtype(config, on)
    setting = Setting(
        context=DEFAULT_CONTEXT if context is None else context,
        batch=batch,
        chunk=chunk,
        policy=policy,
        kv_dtype=kv_dtype,
        backend=on,
    )
    mem = system_memory(memory, on)
    b = budget(layout, weights, setting, mem.available)
    est = Estimate(src.name, src, layout, setting, b, mem, notes=notes)
    est.trained_context = trained_context(config)
    est.memory_arg = memory
    est.weight_bits = weight_bits
    if on == "metal" and mem.total:
        est.wired = wired_advice(b.total, mem.total, mem.available)
        est.load_wired_limit = load_wired_limit(weights.bytes, mem.available)
    if search:
        est.max_context = max_context(layout, weights, setting, mem.available)
        est.max_batch = max_batch(layout, weights, setting, mem.available)
    note = _window_note(layout, setting)
    if note:
        notes.append(note)
    if weights.bytes > mem.available:
        est.fit_notes.append("the weights alone exceed the available memory")
    elif est.max_context == 0:
        est.fit_notes.append(f"not even one prefill chunk fits at batch {batch}")
    return est


def with_weight_bits(config: dict, bits: int) -> dict:
    """The config of an MLX conversion quantized to ``bits`` (what ``mlx_lm.convert -q``
    writes: group 64, affine), replacing any quantization the checkpoint has."""
    if bits not in (2, 3, 4, 5, 6, 8):
        raise BadInput(f"--weight-bits must be one of 2, 3, 4, 5, 6, 8, got {bits}")
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    config["quantization"] = {"group_size": 64, "bits": bits}
    return config


def check_fits(
    path: str | Path,
    policy: KVPolicy | None = None,
    context: int | None = None,
    batch: int = 1,
) -> Estimate:
    """Raise UserError if the model in ``path`` will not fit (the engine's pre-load check)."""
    plan = estimate_model(
        from_path(Path(path)), policy or KVPolicy(), context=context, batch=batch, search=False
    )
    if not plan.budget.fits:
        b = plan.budget
        if b.weights.bytes > b.available:
            raise UserError(
                f"{plan.name} does not fit: its weights alone need {gib(b.weights.bytes)} "
                f"and {gib(b.available)} is available (see 'mlxkv plan'); use --force to try"
            )
        raise UserError(
            f"{plan.name} needs about {gib(b.total)} at {plan.setting.context} tokens "
            f"(weights {gib(b.weights.bytes)}, KV {gib(b.kv.peak_allocated)}) but "
            f"{gib(b.available)} is available; try --kv-window/--kv-bits or a shorter "
            "context (see 'mlxkv plan'), or --force"
        )
    return plan
