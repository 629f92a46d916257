"""Engine overhead: the mlxkv engine (``Session``, full cache, live KV stats per token)
against mlx-lm's ``stream_generate`` on the same prompt text, greedy.

Both sides are timed the same way, from outside: prefill tok/s = prompt tokens / time to
the first token; decode tok/s = (tokens - 1) / (last token - first token). (The two
libraries' own tps fields count tokens differently, by one.) Runs alternate A-B, B-A so
a slow minute on the shared machine hits both; we report medians and the median of the
per-repeat ratios.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field


@dataclass
class Timing:
    prompt_tokens: int
    generated: int
    prefill_tps: float
    decode_tps: float


@dataclass
class EngineResult:
    prompt_tokens: int
    decode_tokens: int
    repeats: int
    mlxkv: list[Timing] = field(default_factory=list)
    mlx_lm: list[Timing] = field(default_factory=list)

    def median(self, side: str, what: str) -> float:
        return statistics.median(getattr(t, what) for t in getattr(self, side))

    def ratio(self, what: str) -> float:
        """Median of per-repeat mlxkv / mlx-lm ratios."""
        pairs = zip(self.mlxkv, self.mlx_lm, strict=True)
        return statistics.median(getattr(a, what) / getattr(b, what) for a, b in pairs)


def _timing(n_prompt: int, start: float, stamps: list[float]) -> Timing:
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
    return Timing(n_prompt, len(stamps), n_prompt / (stamps[0] - start), decode)


def run_mlxkv(gen, prompt: str, n_prompt: int, max_tokens: int, chunk: int) -> Timing:
    from mlxkv.engine.events import TokenDelta
    from mlxkv.engine.session import GenerationSettings

    gen.reset()
    settings = GenerationSettings(max_tokens=max_tokens, prefill_step=chunk)
    stamps: list[float] = []
    start = time.perf_counter()
    for ev in gen.run(prompt, settings):
        if isinstance(ev, TokenDelta) and ev.token >= 0:
            stamps.append(time.perf_counter())
    return _timing(n_prompt, start, stamps)


def run_mlx_lm(loaded, prompt: str, n_prompt: int, max_tokens: int, chunk: int) -> Timing:
    from mlx_lm.generate import stream_generate

    stamps: list[float] = []
    start = time.perf_counter()
    for _ in stream_generate(
        loaded.model, loaded.tokenizer, prompt, max_tokens=max_tokens, prefill_step_size=chunk
    ):
        stamps.append(time.perf_counter())
    return _timing(n_prompt, start, stamps)


def measure(loaded, prompt: str, decode: int, repeats: int, chunk: int, log) -> EngineResult:
    from mlxkv.engine.batch import encode_prompt
    from mlxkv.engine.session import Session

    n_prompt = len(encode_prompt(loaded.tokenizer, prompt))
    gen = Session(loaded)
    res = EngineResult(n_prompt, decode, repeats)
    # Warm-up: first calls pay for allocations and graph setup.
    run_mlxkv(gen, prompt, n_prompt, 2, chunk)
    run_mlx_lm(loaded, prompt, n_prompt, 2, chunk)
    for r in range(repeats):
        order = ("mlxkv", "mlx_lm") if r % 2 == 0 else ("mlx_lm", "mlxkv")
        for side in order:
            if side == "mlxkv":
                t = run_mlxkv(gen, prompt, n_prompt, decode, chunk)
            else:
                t = run_mlx_lm(loaded, prompt, n_prompt, decode, chunk)
            getattr(res, side).append(t)
            log(
                f"engine {r + 1}/{repeats} {side}: prefill {t.prefill_tps:.1f} tok/s, "
                f"decode {t.decode_tps:.2f} tok/s ({t.generated} tokens)"
            )
    return res
