"""``GET /metrics``: the scheduler's status in Prometheus' text format.

A custom collector reads the status on each scrape (nothing is counted twice: the counters
are the scheduler's own, since the server started), so the figures are exactly those of
``GET /v1/status`` at that moment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mlxkv.server import observe

# name (after mlxkv_) -> (memory key, help)
MEMORY_GAUGES = {
    "kv_bytes_actual": ("kv_bytes_actual", "KV bytes MLX holds for the running requests"),
    "kv_bytes_predicted": (
        "kv_bytes_predicted",
        "KV bytes the memory model predicts for the running requests",
    ),
    "reserved_bytes": ("reserved_bytes", "KV bytes reserved by admitted requests"),
    "weights_bytes": ("weights_bytes", "bytes of the model's weights"),
    "runtime_bytes": ("runtime_bytes", "bytes the runtime needs beside weights and KV"),
    "active_bytes": ("active_bytes", "bytes MLX holds now"),
    "peak_bytes": ("peak_bytes", "the most bytes MLX has held"),
    "cache_bytes": ("cache_bytes", "freed buffers MLX keeps for reuse (beside active_bytes)"),
}
# name (after mlxkv_, before _total) -> (status key, help)
COUNTERS = {
    "requests_finished": ("requests_finished", "requests that ended"),
    "prompt_tokens_prefilled": (
        "prompt_tokens_prefilled",
        "prompt tokens prefilled, not served from a cache (a prefix shared by a batch counts "
        "for each request in it)",
    ),
    "prompt_tokens_cached": ("prompt_tokens_cached", "prompt tokens served from a cache"),
    "tokens_generated": ("tokens_generated", "tokens generated"),
    "draft_tokens": (
        "draft_tokens",
        "tokens guessed from the conversation and checked in a decode step (prompt lookup)",
    ),
    "draft_tokens_accepted": (
        "draft_tokens_accepted",
        "checked draft tokens the model agreed with (each saved a decode step)",
    ),
    "scheduler_steps": ("steps", "scheduler rounds"),
}


class StatusCollector:
    """Turns ``status()`` (the dict ``GET /v1/status`` returns) into metric families."""

    def __init__(self, status: Callable[[], dict]):
        self.status = status

    def collect(self) -> Iterator[Metric]:
        s = self.status()
        mem = observe.memory(s)

        info = GaugeMetricFamily(
            "mlxkv_server_info",
            "the served model and its default KV policy",
            labels=["model", "policy"],
        )
        info.add_metric([str(s.get("model", "")), str(s.get("policy", ""))], 1)
        yield info

        budget = GaugeMetricFamily(
            "mlxkv_memory_budget_bytes", "bytes the server may use (absent: no budget set)"
        )
        if mem["budget_bytes"] is not None:
            budget.add_metric([], mem["budget_bytes"])
        yield budget
        for name, (key, doc) in MEMORY_GAUGES.items():
            yield GaugeMetricFamily(f"mlxkv_{name}", doc, value=mem[key])

        yield from _machine(observe.machine(s))

        yield GaugeMetricFamily(
            "mlxkv_requests_waiting", "requests waiting to start", value=observe.waiting(s)
        )
        yield GaugeMetricFamily(
            "mlxkv_requests_running",
            "requests decoding or prefilling",
            value=len(observe.running(s)) + observe.integer(s, "prefilling"),
        )
        yield GaugeMetricFamily(
            "mlxkv_tokens_per_second",
            "tokens generated per second over the last few seconds",
            value=observe.real(s, "tokens_per_second"),
        )

        batches = observe.batches(s)
        yield GaugeMetricFamily(
            "mlxkv_batches_waiting",
            "batches (/v1/batches) waiting to run",
            value=batches["waiting"],
        )
        running = GaugeMetricFamily(
            "mlxkv_batch_requests",
            "the running batch's requests: in flight, answered, in all (0: no batch runs)",
            labels=["state"],
        )
        for state in ("in_flight", "answered", "total"):
            running.add_metric([state], batches[state])
        yield running

        counts = observe.counters(s)
        for name, (key, doc) in COUNTERS.items():
            yield CounterMetricFamily(f"mlxkv_{name}", doc, value=counts[key])
        refused = CounterMetricFamily(
            "mlxkv_requests_refused",
            "requests refused: busy (429, the queue is full), too_large (can never fit)",
            labels=["reason"],
        )
        for reason, n in observe.refused(s).items():
            refused.add_metric([reason], n)
        yield refused

        cache = observe.prefix_cache(s)
        families = {
            "entries": GaugeMetricFamily(
                "mlxkv_prefix_cache_entries", "prefixes kept", labels=["tier"]
            ),
            "bytes": GaugeMetricFamily(
                "mlxkv_prefix_cache_bytes", "bytes of the prefixes kept", labels=["tier"]
            ),
            "limit_bytes": GaugeMetricFamily(
                "mlxkv_prefix_cache_limit_bytes", "byte limit of the tier", labels=["tier"]
            ),
            "hits": CounterMetricFamily(
                "mlxkv_prefix_cache_hits", "lookups the tier served", labels=["tier"]
            ),
            "hit_ratio": GaugeMetricFamily(
                "mlxkv_prefix_cache_hit_ratio",
                "hits of the tier over all lookups",
                labels=["tier"],
            ),
        }
        for tier in ("memory", "disk"):
            for key, family in families.items():
                family.add_metric([tier], cache[tier][key])
        yield from families.values()
        yield CounterMetricFamily(
            "mlxkv_prefix_cache_misses", "lookups no tier served", value=cache["misses"]
        )
        yield CounterMetricFamily(
            "mlxkv_prefix_cache_tokens_reused",
            "prompt tokens taken from the prefix cache",
            value=cache["tokens_reused"],
        )


def _machine(m: dict | None) -> Iterator[Metric]:
    """The machine's free memory against the floor (nothing where the server keeps none)."""
    if m is None:
        return
    free = GaugeMetricFamily("mlxkv_machine_free_bytes", "memory the machine has free now")
    if m["free_bytes"] is not None:
        free.add_metric([], m["free_bytes"])
    yield free
    yield GaugeMetricFamily(
        "mlxkv_machine_floor_bytes",
        "memory kept free for the machine's other programs (--memory-floor)",
        value=m["floor_bytes"],
    )
    yield GaugeMetricFamily(
        "mlxkv_machine_under_floor",
        "1 while the machine's free memory is under the floor",
        value=int(m["under_floor"]),
    )
    yield CounterMetricFamily(
        "mlxkv_machine_times_under_floor",
        "times the machine's free memory fell under the floor",
        value=m["times_under"],
    )
    yield CounterMetricFamily(
        "mlxkv_machine_given_back_bytes",
        "bytes given back under the floor (MLX's freed buffers, kept prefixes to disk)",
        value=m["given_back_bytes"],
    )


def registry(status: Callable[[], dict]) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StatusCollector(status))
    return reg


def exposition(reg: CollectorRegistry) -> tuple[bytes, str]:
    """The text format and its content type."""
    return generate_latest(reg), CONTENT_TYPE_LATEST
