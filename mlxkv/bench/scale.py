"""How big a run is: the full run (about 20 min on a quiet 2-core x86 box) and ``--quick``.

Every size lives here so the report can print the exact parameters it ran with.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Scale:
    name: str
    # engine overhead: a raw-text prompt, then greedy decode; interleaved repeats
    engine_prompt: int
    engine_decode: int
    engine_repeats: int
    # policy speed: prompt past the window (so bounded caches evict), then decode
    speed_prompt: int
    speed_decode: int
    speed_repeats: int
    speed_configs: tuple[str, ...]  # mlxkv policies raced against their mlx-lm peer
    # long streams: bounded policies go this far; unbounded ones stop at the context
    stream_tokens: int
    checkpoints: tuple[int, ...]
    chunk: int
    stream_decode: int  # decoded tokens at the start and at the end of a stream
    kept: int  # tokens every bounded cache keeps, sinks included (equal memory)
    sinks: int
    stream_configs: tuple[str, ...]
    # batch
    batch_prompts: int
    batch_max_tokens: int
    batch_rounds: int
    # roofline: bytes per bandwidth probe
    bandwidth_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


FULL = Scale(
    name="full",
    engine_prompt=384,
    engine_decode=48,
    engine_repeats=3,
    speed_prompt=1536,
    speed_decode=32,
    speed_repeats=1,
    # full vs KVCache is the engine section's comparison
    speed_configs=("window", "sink-window", "8bit", "4bit", "sink-4bit"),
    stream_tokens=12288,
    checkpoints=(2048, 8192, 12288),
    chunk=512,
    stream_decode=24,
    kept=1024,
    sinks=4,
    # What the targets need (sink+window vs full vs mlx-lm's rotating cache, 4-bit vs
    # full); window, 8-bit and sink+4-bit are in the speed pass only, to keep the run near
    # the run short on 2 cores (add them with --streams; --stream-tokens 16384 for 16k).
    stream_configs=("full", "4bit", "sink-window", "lm-rot"),
    batch_prompts=8,
    batch_max_tokens=64,
    batch_rounds=1,
    bandwidth_bytes=512 * 2**20,
)

# CI smoke test: every section runs, on tiny sizes (the numbers mean little).
QUICK = Scale(
    name="quick",
    engine_prompt=64,
    engine_decode=6,
    engine_repeats=1,
    speed_prompt=128,
    speed_decode=3,
    speed_repeats=1,
    speed_configs=("sink-window", "4bit"),
    stream_tokens=256,
    checkpoints=(64, 128, 256),
    chunk=64,
    stream_decode=3,
    kept=64,
    sinks=4,
    stream_configs=("full", "4bit", "sink-window", "lm-rot"),
    batch_prompts=2,
    batch_max_tokens=4,
    batch_rounds=1,
    bandwidth_bytes=64 * 2**20,
)
