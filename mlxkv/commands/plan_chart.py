"""``plan --chart``: total memory against context for the plan's policy and the usual
alternatives, with the budget as a line, drawn in the terminal or saved as a PNG.

Where a curve crosses the budget is the largest context that policy fits
(``mlxkv.memory.budget.max_context``, listed under the chart).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from mlxkv.errors import UserError
from mlxkv.files import atomic_write_with

POINTS = 64
WIDTH, HEIGHT = 64, 16
MARKS = "*o+x#@"
SINK_WINDOW = 4092
SINKS = 4


@dataclass(frozen=True)
class Curve:
    name: str
    totals: list[int]  # bytes at each context of ``Chart.contexts``
    max_context: int | None  # where it crosses the budget (None: never)


@dataclass(frozen=True)
class Chart:
    model: str
    contexts: list[int]
    curves: list[Curve]
    budget: int
    requested: int


def _policies(est) -> list[tuple[str, object]]:
    from mlxkv.policy import KVPolicy

    s = est.setting
    window = s.policy.window or SINK_WINDOW
    sinks = s.policy.sinks if s.policy.window else SINKS
    out = [
        (f"this plan ({s.policy.describe()})", s.policy),
        ("full", KVPolicy()),
        (f"sink {sinks} + window {window}", KVPolicy(window=window, sinks=sinks)),
        ("4-bit KV", KVPolicy(bits=4)),
        ("keys 4 / values 2", KVPolicy(key_bits=4, value_bits=2)),
    ]
    seen, unique = set(), []
    for name, p in out:
        if p not in seen:
            seen.add(p)
            unique.append((name, p))
    return unique


def curves(est) -> Chart:
    from mlxkv.memory.budget import budget, max_context
    from mlxkv.memory.estimate import check_policy
    from mlxkv.policy import PolicyError

    s, avail = est.setting, est.budget.available
    layout, weights = est.layout, est.budget.weights
    top = max(2 * s.context, 8192)
    contexts = [max(1, top * i // POINTS) for i in range(1, POINTS + 1)]
    out = []
    for name, policy in _policies(est):
        try:
            check_policy(layout, policy)
        except PolicyError:
            continue  # e.g. no growing layer to window, or a head dim 4-bit groups miss
        at = replace(s, policy=policy)
        totals = [budget(layout, weights, replace(at, context=c), avail).total for c in contexts]
        out.append(Curve(name, totals, max_context(layout, weights, at, avail)))
    return Chart(est.name, contexts, out, avail, s.context)


def _crossing(c: Curve) -> str:
    if c.max_context is None:
        return "fits at any context"
    return f"fits up to {c.max_context:,} tokens"


def chart_text(chart: Chart) -> str:
    """A character plot: one mark per policy, '-' the budget, '|' the requested context."""
    peak = max(max(c.totals) for c in chart.curves)
    ymax = max(chart.budget * 1.25, min(peak, chart.budget * 3))
    grid = [[" "] * WIDTH for _ in range(HEIGHT)]

    def row(v: float) -> int:
        return HEIGHT - 1 - min(HEIGHT - 1, int(v / ymax * (HEIGHT - 1) + 0.5))

    def col(x: int) -> int:
        return min(WIDTH - 1, int(x / chart.contexts[-1] * (WIDTH - 1) + 0.5))

    for x in range(WIDTH):
        grid[row(chart.budget)][x] = "-"
    req = col(chart.requested)
    for r in range(HEIGHT):
        if grid[r][req] == " ":
            grid[r][req] = "|"
    for mark, c in zip(MARKS, chart.curves, strict=False):
        for x, total in zip(chart.contexts, c.totals, strict=True):
            grid[row(min(total, ymax))][col(x)] = mark
    lines = [f"  total memory (GiB) against context, {chart.model}"]
    for r, cells in enumerate(grid):
        label = ""
        if r in (0, HEIGHT // 2, HEIGHT - 1):
            label = f"{ymax * (HEIGHT - 1 - r) / (HEIGHT - 1) / 2**30:.1f}"
        lines.append(f"  {label:>7} |{''.join(cells)}")
    end = chart.contexts[-1]
    lines.append(f"  {'':>7} +{'-' * WIDTH}")
    lines.append(f"  {'':>7}  0{f'{end // 2:,}':^{WIDTH - 2 * len(f'{end:,}')}}{end:,} tokens")
    lines.append(
        f"  - budget {chart.budget / 2**30:.2f} GiB   | requested {chart.requested:,} tokens"
    )
    for mark, c in zip(MARKS, chart.curves, strict=False):
        lines.append(f"  {mark} {c.name}: {_crossing(c)}")
    return "\n".join(lines)


def chart_file(chart: Chart, path: str) -> str:
    """Save the chart as a PNG; refuses to replace an existing file. Returns a line to print."""
    target = Path(path)
    if target.suffix.lower() != ".png":
        raise UserError(f"--chart {path}: give a file name ending in .png, or no name")
    if target.exists():
        raise UserError(f"--chart {path} exists; choose a new file name (it is not replaced)")
    if not target.parent.is_dir():
        raise UserError(f"--chart {path}: folder {target.parent} does not exist")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError(
            "--chart FILE.png needs matplotlib (pip install matplotlib); --chart alone "
            "draws in the terminal"
        ) from None
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for c in chart.curves:
        label = f"{c.name} ({_crossing(c)})"
        ax.plot(chart.contexts, [t / 2**30 for t in c.totals], label=label)
    ax.axhline(chart.budget / 2**30, color="black", linestyle="--", label="budget")
    ax.axvline(chart.requested, color="grey", linestyle=":", label="requested context")
    ax.set_ylim(0, max(chart.budget * 1.5, min(max(max(c.totals) for c in chart.curves),
                                               chart.budget * 3)) / 2**30)  # fmt: skip
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("total memory (GiB)")
    ax.set_title(f"{chart.model}: memory against context")
    ax.legend(fontsize=7)
    fig.tight_layout()
    try:
        atomic_write_with(
            target, lambda f: fig.savefig(f, format="png"), what="--chart", overwrite=False
        )
    finally:
        plt.close(fig)
    return f"chart saved to {path}"
