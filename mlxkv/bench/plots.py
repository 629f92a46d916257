"""PNG plots for the report. matplotlib is optional: without it the report says how to get
the plots and everything else is still written."""

from __future__ import annotations

from pathlib import Path

from mlxkv.bench.quality import smoothed

MISSING = "plots skipped: matplotlib is not installed (pip install matplotlib)"


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def loss_over_position(streams, labels, context, path: Path, width: int) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, r in streams.items():
        x, y = smoothed(r.losses, width)
        ax.plot(x, y, label=labels[key], linewidth=1.4)
    if context and context < max(len(r.losses) for r in streams.values()):
        ax.axvline(context, color="grey", linestyle="--", linewidth=1)
        ax.text(context, ax.get_ylim()[1], " model context", va="top", fontsize=8)
    ax.set_xlabel("position in the stream (tokens)")
    ax.set_ylabel(f"next-token loss (nats, mean of {width})")
    ax.set_title("Long-stream loss per KV cache policy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def speed_over_position(streams, labels, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, r in streams.items():
        ax.plot(r.chunk_ends(), r.chunk_tps(), label=labels[key], linewidth=1.2)
    ax.set_xlabel("position in the stream (tokens)")
    ax.set_ylabel("tokens/s (per prefill chunk, loss included)")
    ax.set_title("Speed along the stream")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def kv_memory(streams, labels, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, r in streams.items():
        xs = [c.tokens for c in r.checkpoints]
        ys = [c.kv_bytes / 2**20 for c in r.checkpoints]
        ax.plot(xs, ys, marker="o", label=labels[key])
    ax.set_xlabel("tokens in the stream")
    ax.set_ylabel("KV cache (MiB, sum of nbytes)")
    ax.set_title("KV cache bytes held")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def roofline(rows, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r["what"] for r in rows]
    ax.barh(names, [r["bound_tps"] for r in rows], color="#ddd", label="bandwidth bound")
    ax.barh(names, [r["decode_tps"] for r in rows], color="#3a7", label="measured decode")
    for i, r in enumerate(rows):
        ax.text(r["decode_tps"], i, f" {100 * r['fraction']:.0f}%", va="center", fontsize=8)
    ax.set_xlabel("decode tokens/s")
    ax.set_title("Decode vs the memory-bandwidth bound")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
