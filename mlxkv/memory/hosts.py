"""Memory per host when a model is split across N machines the way mlx-lm splits it.

* tensor (``model.shard(group)``): every rank holds 1/N of each attention layer's query and
  KV heads and of the MLP; embeddings, norms and the head are whole on every rank. Caches
  hold ``kv_heads / N`` heads per layer. MLA latents and recurrent states are not split by
  mlx-lm's ``shard()``: every rank keeps them whole.
* pipeline (``model.model.pipeline(group)``): rank r runs a contiguous run of layers, the
  low ranks taking one extra layer when N does not divide them, rank 0 the *last* layers
  (mlx-lm's ``PipelineMixin``); every rank keeps the embeddings, final norm and head.

Weights per host are counted exactly by building mlx-lm's model lazily from the config and
splitting it with a stand-in group (``shard_linear`` only asks a group its size and rank):
nothing is allocated, and the parameter shapes are those each real rank will hold.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mlxkv.errors import one_line
from mlxkv.memory.config import BadInput, text_view
from mlxkv.memory.layout import Layout
from mlxkv.memory.weights import Weights

SPLIT_MODES = ("tensor", "pipeline")
# Cache roles whose heads mlx-lm's shard() divides N ways.
_SPLIT_ROLES = ("attention", "sliding", "chunked")


@dataclass(frozen=True)
class StandInGroup:
    """What ``shard_linear`` and ``pipeline`` read from an ``mx.distributed.Group``."""

    rank_: int
    size_: int

    def rank(self) -> int:
        return self.rank_

    def size(self) -> int:
        return self.size_


def pipeline_split(num_layers: int, n: int) -> list[tuple[int, int]]:
    """``(start, end)`` layer range of each rank, as mlx-lm's ``PipelineMixin.pipeline``."""
    base, extra = divmod(num_layers, n)
    sizes = [base + (1 if r < extra else 0) for r in range(n)]
    ranges = []
    for r in range(n):
        start = sum(sizes[r + 1 :])
        ranges.append((start, start + sizes[r]))
    return ranges


def check_split(config: dict, n: int, mode: str) -> None:
    """Raise BadInput (one line) when the model cannot be split ``n`` ways by ``mode``."""
    if mode not in SPLIT_MODES:
        raise BadInput(f"--shard must be one of {', '.join(SPLIT_MODES)}, got '{mode}'")
    if n < 1:
        raise BadInput(f"the number of hosts must be at least 1, got {n}")
    view = text_view(config)
    if mode == "pipeline":
        layers = view.get("num_hidden_layers") or view.get("n_layer") or 0
        if layers and n > layers:
            raise BadInput(
                f"a pipeline over {n} hosts needs at least {n} layers; the model has {layers}"
            )
        return
    heads = view.get("num_attention_heads") or 0
    kv_heads = view.get("num_key_value_heads") or heads
    for what, count in (("attention heads", heads), ("KV heads", kv_heads)):
        if count and count % n:
            raise BadInput(
                f"tensor parallelism over {n} hosts needs {what} divisible by {n}; the model "
                f"has {count}: use a host count that divides {count}"
            )


def host_layout(layout: Layout, n: int, rank: int, mode: str) -> Layout:
    """The caches rank ``rank`` of ``n`` builds."""
    if n == 1:
        return layout
    if mode == "pipeline":
        start, end = pipeline_split(len(layout.layers), n)[rank]
        return replace(layout, layers=layout.layers[start:end])
    layers = tuple(
        replace(
            li,
            parts=tuple(
                replace(p, kv_heads=p.kv_heads // n) if p.role in _SPLIT_ROLES else p
                for p in li.parts
            ),
        )
        for li in layout.layers
    )
    return replace(layout, layers=layers)


def _build(config: dict):
    """mlx-lm's model for ``config``, lazily (nothing allocated), as ``probe`` builds it."""
    import importlib

    from mlxkv.errors import one_line
    from mlxkv.memory.probe import module_name

    module = module_name(config)
    try:
        arch = importlib.import_module(f"mlx_lm.models.{module}")
        return arch.Model(arch.ModelArgs.from_dict(config))
    except (Exception, SystemExit) as e:
        raise BadInput(f"mlx-lm cannot build a '{module}' model: {one_line(e)}") from None


def _param_bytes(module, wb: int, mx) -> tuple[int, int]:
    """(bytes as held, parameters) of ``module``: floating ones at ``wb`` bytes each."""
    from mlx.utils import tree_flatten

    total = params = 0
    for _, p in tree_flatten(module.parameters()):
        total += p.size * wb if mx.issubdtype(p.dtype, mx.floating) else p.nbytes
        params += p.size
    return total, params


def host_weights(
    config: dict,
    n: int,
    mode: str,
    weight_dtype: str,
    dequantize: bool,
    ranks: list[int] | None = None,
) -> list[Weights]:
    """Parameter bytes each rank (of ``ranks``, default all) holds, from mlx-lm's model
    split with a stand-in group."""
    import mlx.core as mx
    import mlx.nn as nn

    from mlxkv.memory.dtypes import dtype_bytes
    from mlxkv.memory.probe import _quantize

    wb = dtype_bytes(weight_dtype)
    ranks = list(range(n)) if ranks is None else ranks
    how = f"mlx-lm model split {n} ways ({mode})"
    if mode == "pipeline" and n > 1:
        table = PipelineWeights(config, weight_dtype, dequantize)
        ranges = pipeline_split(len(table.layers), n)
        return [replace(table.rank(*ranges[r]), source=how) for r in ranks]
    out = []
    for rank in ranks:
        model = _build(config)
        if not dequantize:
            _quantize(nn, model, config)
        if n > 1:
            shard(model, StandInGroup(rank, n), config.get("model_type", "the model"))
        total, params = _param_bytes(model, wb, mx)
        out.append(Weights(total, None, params, how))
    return out


class PipelineWeights:
    """Bytes of every layer of mlx-lm's model and of the rest, from one lazy build: a
    pipeline rank holds the rest (embeddings, final norm, head) and its run of layers
    (``PipelineMixin.pipeline`` keeps ``layers[start:end]`` and drops the others)."""

    def __init__(self, config: dict, weight_dtype: str, dequantize: bool):
        import mlx.core as mx
        import mlx.nn as nn

        from mlxkv.memory.dtypes import dtype_bytes
        from mlxkv.memory.probe import _quantize

        wb = dtype_bytes(weight_dtype)
        model = _build(config)
        if not dequantize:
            _quantize(nn, model, config)
        self.layers = [_param_bytes(layer, wb, mx) for layer in model.model.layers]
        total, params = _param_bytes(model, wb, mx)
        self.rest = (
            total - sum(b for b, _ in self.layers),
            params - sum(p for _, p in self.layers),
        )

    def rank(self, start: int, end: int) -> Weights:
        run = self.layers[start:end]
        total = self.rest[0] + sum(b for b, _ in run)
        params = self.rest[1] + sum(p for _, p in run)
        return Weights(total, None, params, "mlx-lm model split by layers (pipeline)")


def split_support(config: dict) -> dict[str, bool]:
    """Which splits mlx-lm's model class for ``config`` offers (built lazily, no weights)."""
    return splits_of(_build(config))


def splits_of(model) -> dict[str, bool]:
    """Which splits mlx-lm gives ``model``: ``shard()`` (tensor), ``model.pipeline()``."""
    return {
        "tensor": hasattr(model, "shard"),
        "pipeline": hasattr(model, "model") and hasattr(model.model, "pipeline"),
    }


def choose_split(config: dict, mode: str, n: int, can: dict[str, bool] | None = None) -> str:
    """``auto`` -> tensor where the model has ``shard()`` and splits ``n`` ways so, else
    pipeline; BadInput (one line) when the model cannot be split ``n`` ways that way.
    ``can``: :func:`splits_of` the model, where it is built already."""
    can = split_support(config) if can is None else can
    model_type = config.get("model_type", "this model")
    if mode not in ("auto", *SPLIT_MODES):
        raise BadInput(f"--shard must be one of auto, {', '.join(SPLIT_MODES)}, got '{mode}'")
    if mode == "auto":
        if not (can["tensor"] or can["pipeline"]):
            raise BadInput(
                f"{model_type} cannot be split across hosts: mlx-lm gives it neither shard() "
                "nor model.pipeline(); it runs on one host only"
            )
        mode = "tensor" if can["tensor"] else "pipeline"
        if mode == "tensor" and can["pipeline"]:
            try:
                check_split(config, n, mode)
            except BadInput:
                mode = "pipeline"  # the heads do not divide n ways: split the layers
    if not can[mode]:
        what = "shard()" if mode == "tensor" else "model.pipeline()"
        other = "pipeline" if mode == "tensor" else "tensor"
        hint = f"; try --shard {other}" if can[other] else "; it runs on one host only"
        raise BadInput(f"{model_type} has no {what} in mlx-lm: it cannot be split by {mode}{hint}")
    try:
        check_split(config, n, mode)
    except BadInput as e:
        if mode == "pipeline":
            raise
        hint = (
            ", or --shard pipeline"
            if can["pipeline"]
            else f" (mlx-lm has no pipeline split for {model_type})"
        )
        raise BadInput(f"{e}{hint}") from None
    return mode


def shard(model, group, model_type: str) -> None:
    """``model.shard(group)``, its refusal one line: mlx-lm splits packed (quantized)
    weights along their groups, which need not divide ``group.size()`` ways."""
    try:
        model.shard(group)
    except ValueError as e:
        raise BadInput(
            f"mlx-lm cannot split {model_type}'s weights {group.size()} ways by tensor "
            f"({one_line(e).rstrip('.')}); use another host count"
        ) from None


def host_memories(spec: str | None, n: int) -> list[str | None]:
    """``--memory`` for N hosts: one size for all, or one per host (comma separated)."""
    if spec is None:
        return [None] * n
    parts = [p.strip() for p in spec.split(",")]
    if not all(parts):
        raise BadInput(
            f"--memory '{spec}' has an empty size between or after its commas; give one size "
            "for every host (--memory 64GB) or one per host (--memory 64GB,32GB)"
        )
    if len(parts) == 1:
        return parts * n
    if len(parts) != n:
        hosts = "1 host" if n == 1 else f"{n} hosts"
        raise BadInput(
            f"--memory lists {len(parts)} sizes for {hosts}; give one size for every host "
            "or one per host, e.g. --memory 64GB,32GB"
        )
    return parts


@dataclass
class HostPlan:
    rank: int
    layers: tuple[int, int]  # [start, end) of the model's layers this rank runs
    layout: Layout
    budget: object  # mlxkv.memory.budget.Budget
    memory: object  # mlxkv.memory.system.SystemMemory
    max_context: int | None = None
    max_batch: int = 0


@dataclass
class HostsPlan:
    mode: str
    hosts: list[HostPlan]

    @property
    def fits(self) -> bool:
        return all(h.budget.fits for h in self.hosts)

    @property
    def tightest(self) -> HostPlan:
        """The host with the least memory to spare: it bounds context and batch."""
        return min(self.hosts, key=lambda h: h.budget.available - h.budget.total)

    @property
    def max_context(self) -> int | None:
        finite = [h.max_context for h in self.hosts if h.max_context is not None]
        return min(finite) if finite else None

    @property
    def max_batch(self) -> int:
        return min(h.max_batch for h in self.hosts)


def plan_hosts(
    config: dict,
    layout: Layout,
    setting,
    n: int,
    mode: str,
    memory: str | None = None,
    search: bool = True,
) -> HostsPlan:
    """Weights, KV, runtime and verdict for each of ``n`` hosts (``setting``: a
    ``mlxkv.memory.budget.Setting``); ``memory`` is ``--memory`` (one size or one per host)."""
    from mlxkv.memory.dtypes import default_weight_dtype
    from mlxkv.memory.system import system_memory

    mode = choose_split(config, mode, n)
    mems = [system_memory(m, setting.backend) for m in host_memories(memory, n)]
    wdtype = default_weight_dtype(config, setting.backend)
    weights = host_weights(config, n, mode, wdtype, dequantize=setting.backend == "cpu")
    return _plan(layout, setting, mode, mems, weights, search)


def _plan(layout: Layout, setting, mode: str, mems, weights, search: bool) -> HostsPlan:
    from mlxkv.memory.budget import budget, max_batch, max_context

    n = len(mems)
    if mode == "pipeline":
        ranges = pipeline_split(len(layout.layers), n)
    else:
        ranges = [(0, len(layout.layers))] * n
    hosts = []
    for rank in range(n):
        lay = host_layout(layout, n, rank, mode)
        avail = mems[rank].available
        b = budget(lay, weights[rank], setting, avail)
        h = HostPlan(rank, ranges[rank], lay, b, mems[rank])
        if search:
            h.max_context = max_context(lay, weights[rank], setting, avail)
            h.max_batch = max_batch(lay, weights[rank], setting, avail)
        hosts.append(h)
    return HostsPlan(mode, hosts)


def fewest_hosts(
    config: dict, layout: Layout, setting, mode: str, memory: str | None, most: int
) -> HostsPlan | None:
    """The plan over the fewest hosts (2 to ``most``, each with ``memory``) split by
    ``mode`` on which every host fits, or None. The model must have that split
    (``split_support``)."""
    from mlxkv.memory.dtypes import default_weight_dtype
    from mlxkv.memory.system import system_memory

    wdtype = default_weight_dtype(config, setting.backend)
    dequantize = setting.backend == "cpu"
    mem = system_memory(memory, setting.backend)
    table = PipelineWeights(config, wdtype, dequantize) if mode == "pipeline" else None
    if table is not None:
        most = min(most, len(table.layers))  # a rank runs one layer at least
    for n in range(2, most + 1):
        try:
            check_split(config, n, mode)
        except BadInput:
            continue  # e.g. heads not divisible n ways: try more hosts
        if table is not None:
            weights = [table.rank(*r) for r in pipeline_split(len(table.layers), n)]
        else:
            try:
                weights = host_weights(config, n, mode, wdtype, dequantize)
            except BadInput:
                continue  # packed weights that do not split n ways: try more hosts
        hp = _plan(layout, setting, mode, [mem] * n, weights, search=False)
        if hp.fits:
            return hp
    return None


def check_host_fits(path, policy, context: int | None, batch: int, n: int, rank: int, mode: str):
    """Raise UserError if rank ``rank`` of ``n`` will not fit this host (the engine's
    pre-load check under mlx.launch; each rank checks its own share and its own memory)."""
    from pathlib import Path

    from mlxkv.errors import UserError
    from mlxkv.memory.budget import budget, gib
    from mlxkv.memory.dtypes import default_weight_dtype
    from mlxkv.memory.estimate import estimate_model
    from mlxkv.memory.source import from_path

    est = estimate_model(from_path(Path(path)), policy, context=context, batch=batch, search=False)
    config, s = est.source.config, est.setting
    mode = choose_split(config, mode, n)
    wdtype = default_weight_dtype(config, s.backend)
    [w] = host_weights(config, n, mode, wdtype, s.backend == "cpu", ranks=[rank])
    b = budget(host_layout(est.layout, n, rank, mode), w, s, est.budget.available)
    if not b.fits:
        raise UserError(
            f"rank {rank} of {n} ({mode}) needs about {gib(b.total)} at {s.context} tokens "
            f"(weights {gib(w.bytes)}, KV {gib(b.kv.peak_allocated)}) but {gib(b.available)} "
            f"is available on this host; see 'mlxkv plan MODEL --hosts {n}', or --force"
        )
