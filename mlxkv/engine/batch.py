"""Many independent prompts through one model, results yielded as each one finishes.

A batch file is a reader that submits its lines to the engine's scheduler
(:mod:`mlxkv.engine.scheduler`) and collects each line's answer: the scheduler decodes the
lines under the batch's policy together (continuous batching: a finished line leaves the
batch and a waiting one is prefilled into its place), with every cache policy, and shares
a prompt prefix that waiting lines have in common (prefilled once, copied into each row).
The runner keeps a queue of twice the batch size submitted, so a freed row is refilled at
once, and reads its input lazily (the file may be long).

Greedy batched outputs are token-identical to one by one: every line is prefilled alone in
its single-sequence caches, with the same chunking, and joins the batch at its own
positions. Sampled lines with a ``seed`` draw from their own PRNG key, so their text does
not depend on which other prompts share the batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from mlxkv.engine.events import Embedding, Failed, Finished
from mlxkv.engine.request import GenerationSettings, encode_prompt, encode_text
from mlxkv.engine.scheduler import Request as EngineRequest
from mlxkv.engine.scheduler import Scheduler
from mlxkv.errors import UserError
from mlxkv.models.loader import LoadedModel
from mlxkv.policy import KVPolicy


@dataclass(frozen=True)
class Request:
    key: object  # the caller's handle, returned in the Result
    prompt: str | list[int]  # the full prompt text (chat template already applied), or ids
    settings: GenerationSettings
    # None: an answer; "last" or "mean": the prompt's embedding (the scheduler's
    # Request.embed), in a full cache of its own
    embed: str | None = None


@dataclass
class Result:
    key: object
    text: str = ""
    finish_reason: str | None = None  # stop | length | stop_string | context
    prompt_tokens: int = 0
    generation_tokens: int = 0  # an EOS counts, like a session's stats
    latency_s: float = 0.0  # prefill start -> finished
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    error: str | None = None  # set instead of text when this prompt could not run
    vector: tuple[float, ...] | None = None  # an embedding's (not normalized)


def why_not_batched(loaded: LoadedModel, policy: KVPolicy) -> str | None:
    """None if ``policy`` caches can be batched on this model, else the reason."""
    from mlxkv.caches import make_caches
    from mlxkv.caches.batched import batched_form

    why = batched_form(make_caches(loaded.model, policy))
    return None if why is None else f"{why} under the {policy.describe()} cache"


class KVCheck:
    """Batched KV bytes, actual (the caches' nbytes) next to predicted, at every step: an
    observer of the scheduler's batched steps, for ``batch --stats``."""

    def __init__(self, loaded: LoadedModel):
        self.layout, self.dtype = loaded.kv_layout, loaded.dtype
        self.steps = self.mismatches = 0
        self.peak_actual = self.peak_predicted = 0
        self.first_mismatch: tuple[int, int] | None = None

    def __call__(self, policy: KVPolicy, caches: list) -> None:
        from mlxkv.memory.predictor import batch_allocated

        actual = sum(c.nbytes for c in caches)
        predicted = batch_allocated(self.layout, policy, caches[0].n, self.dtype)
        self.steps += 1
        if actual != predicted:
            self.mismatches += 1
            self.first_mismatch = self.first_mismatch or (actual, predicted)
        self.peak_actual = max(self.peak_actual, actual)
        self.peak_predicted = max(self.peak_predicted, predicted)

    def summary(self) -> dict:
        return {
            "kv_bytes_actual_peak": self.peak_actual,
            "kv_bytes_predicted_peak": self.peak_predicted,
            "kv_steps_checked": self.steps,
            "kv_steps_mismatched": self.mismatches,
        }


class BatchRunner:
    """Submits requests to a scheduler, ``batch_size`` decoding together."""

    def __init__(
        self,
        loaded: LoadedModel,
        policy: KVPolicy | None = None,
        batch_size: int = 16,
        prefill_step: int = 512,
        share_prefix: bool = True,
        check_kv: bool = False,  # compare batched KV bytes with the prediction every step
        draft_tokens: int = 0,  # prompt lookup drafts (see Scheduler)
    ):
        if batch_size < 1:
            raise UserError(f"--batch-size must be at least 1, got {batch_size}")
        self.loaded = loaded
        self.policy = policy or KVPolicy()
        self.batch_size = batch_size
        self.prefill_step = prefill_step
        self.fallback_reason = why_not_batched(loaded, self.policy)
        self.share_prefix = share_prefix
        self.kv_check = KVCheck(loaded) if check_kv else None
        self.scheduler = Scheduler(
            loaded,
            self.policy,
            batch_size,
            share_prefix=share_prefix,
            observer=self.kv_check,
            draft_tokens=draft_tokens,
        )

    def kv_summary(self) -> dict:
        """KV bytes actual vs predicted over the batched steps ({} when not checked)."""
        out = self.kv_check.summary() if self.kv_check else {}
        prefixes = self.prefixes
        if self.kv_check and prefixes is not None:
            out["shared_prefix_tokens"] = prefixes.prefilled_tokens
            out["shared_prefix_rows"] = prefixes.hits
        return out

    @property
    def prefixes(self):
        """The prompt prefix the lines shared (None when none was)."""
        return self.scheduler.shared_prefix(self.policy)

    @property
    def batched(self) -> bool:
        return self.fallback_reason is None

    def run(self, requests: Iterable[Request]) -> Iterator[Result]:
        tok = self.loaded.tokenizer
        sched = self.scheduler
        pending = iter(requests)
        inflight: dict = {}  # handle id -> (request, prompt length, its events, handle)
        exhausted = False
        try:
            while True:
                while not exhausted and len(inflight) < 2 * self.batch_size:
                    req = next(pending, None)
                    if req is None:
                        exhausted = True
                        break
                    events: list = []
                    settings = req.settings
                    if settings.prefill_step != self.prefill_step:
                        from dataclasses import replace

                        settings = replace(settings, prefill_step=self.prefill_step)
                    if isinstance(req.prompt, list):
                        ids = req.prompt
                    elif req.embed:  # as the tokenizer makes them for itself
                        ids = encode_text(tok, req.prompt, True)
                    else:
                        ids = encode_prompt(tok, req.prompt)
                    policy = KVPolicy() if req.embed else None  # no window, no quantization
                    h = sched.submit(
                        EngineRequest(ids, settings, policy, sink=events.append, embed=req.embed)
                    )
                    inflight[h.id] = (req, len(ids), events, h)
                if not inflight:
                    return
                sched.step()
                for hid in [i for i, entry in inflight.items() if entry[3].done]:
                    req, n_prompt, events, _ = inflight.pop(hid)
                    yield _result(req, n_prompt, events)
        finally:
            for *_, h in inflight.values():
                h.cancel()
            while not sched.idle and sched.step():
                pass


def _result(req: Request, n_prompt: int, events: list) -> Result:
    last = events[-1]
    if isinstance(last, Failed):
        return Result(req.key, error=last.message, prompt_tokens=n_prompt)
    assert isinstance(last, Finished)
    s = last.stats  # prefill start -> first token, then first -> last token
    latency = 0.0
    if s.prompt_tps:
        latency += (s.prompt_tokens - s.prompt_tokens_cached) / s.prompt_tps
    if s.generation_tps and s.generation_tokens > 1:
        latency += (s.generation_tokens - 1) / s.generation_tps
    return Result(
        req.key,
        last.text,
        last.finish_reason,
        s.prompt_tokens,
        s.generation_tokens,
        latency,
        s.prompt_tps,
        s.generation_tps,
        vector=next((e.vector for e in events if isinstance(e, Embedding)), None),
    )
