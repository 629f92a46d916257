"""The request scheduler: the one decode loop under every front end.

Requests (prompt token ids, sampling settings, a KV policy, limits) are submitted at any
time, from any thread; each gets a :class:`RequestHandle` whose events (prefill progress,
token deltas with live KV figures, then ``Finished`` or ``Failed``) arrive in order. All
MLX work happens in :meth:`Scheduler.step`, on one thread: either the scheduler's own
(:meth:`Scheduler.start`, for the server) or the caller's, which drives the loop by
reading its events (``generate``, ``chat``'s worker thread, ``batch``). Both run the same
steps in the same order, which is what ranks under ``mlx.launch`` need to stay in lockstep.

One step:

1. Admit new requests: check the policy against the model (once per policy) and the
   prompt against the model's context; refuse with a ``Failed`` event.
2. Drop cancelled requests: their rows leave their batch now.
3. Prefill the oldest waiting requests whose batch has room, chunk by chunk (chunk sizes
   from the caches, exactly as a single sequence prefills), until the round's budget of
   prompt tokens is spent: one long prompt's chunk, or several short prompts. A prompt's
   last chunk ends with its last token and gives the first answer token; the request then
   joins its group. Embedding inputs short enough for one chunk go through the model
   together, padded to the longest, and end there.
4. Decode one token for every group. A group is the requests under one policy: a lone
   request decodes on its own single-sequence caches; when a second joins they merge into
   the policy's batched caches (:mod:`mlxkv.caches.batched`), where every row keeps its
   own positions, evictions and sink shifts. Requests under other policies form other
   groups, stepped in turn, so no request waits for another's whole answer. With
   ``draft_tokens``, a lone greedy request whose last tokens occurred earlier in its
   conversation feeds what followed them there as drafts in the same step and keeps the
   ones the model agrees with (:mod:`mlxkv.engine.lookup`): several tokens a step.

A request that carries a session (``chat``, ``generate``) runs in that session's caches,
reusing what they hold, and keeps its own group: the session gets its caches back, with
every generated token fed, when the answer ends.

With a prefix cache (:mod:`mlxkv.engine.prefix_cache`, the server's), a request without a
session starts from the cached caches that share the longest prefix with its prompt, and
leaves its own caches there when it ends (a batched row is split back out). With a memory
budget (:mod:`mlxkv.engine.admission`), step 3 starts the oldest waiting request only when
its KV reservation fits beside the running ones and the kept prefixes (evicting prefixes
first); a request that can never fit is refused at step 1. With a floor
(:mod:`mlxkv.engine.pressure`, the server's), each round first reads the machine's free
memory (once a second) and, under the floor, gives back MLX's freed buffers and kept
prefixes; step 3 then starts a request beside running ones only where its KV fits above it.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from mlxkv.backend import release_heap
from mlxkv.engine.events import (
    Embedding,
    Event,
    Failed,
    Finished,
    PrefillProgress,
    PromptLogprobs,
    Stats,
    TokenDelta,
)
from mlxkv.engine.finish import FinishRule, token_budget
from mlxkv.engine.kv_stats import KVAccounting
from mlxkv.engine.lookup import MAX_DRAFT_TOKENS, PromptLookup, adapt_draft_length
from mlxkv.engine.request import RESERVE_STEP, GenerationSettings, common_prefix, encode_prompt
from mlxkv.engine.reuse import Checkpoint
from mlxkv.engine.samplers import (
    processor_history,
    processors_for,
    sampler_for,
    sampling_weights_for,
)
from mlxkv.engine.speculative import check_greedy, check_sampled
from mlxkv.errors import UserError, first_line
from mlxkv.memory.budget import human_bytes
from mlxkv.models.loader import LoadedModel
from mlxkv.policy import KVPolicy, uses_kivi

IDLE_WAIT = 0.05  # seconds an idle loop waits before it looks for new requests again
EMBED_PADDING = 0.25  # the share of a shared embedding call that may be padding
HEAP_TRIM_EVERY = 5.0  # seconds of steady work between returns of the C heap's free pages


@dataclass(frozen=True)
class Request:
    ids: list[int]  # the whole prompt's token ids (chat template applied)
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    policy: KVPolicy | None = None  # None: the scheduler's default policy
    logprobs: int | None = None  # None: off; k: the token's logprob and k alternatives
    # None: off; k: every prompt token scored (PromptLogprobs) with its k best alternatives;
    # such a prompt is prefilled whole, never taken from a cache
    prompt_logprobs: int | None = None
    sink: Callable[[Event], None] | None = None  # called on the MLX thread; must not block
    session: object = None  # a Session whose caches the request runs in (see session.py)
    # None: an answer; "last" or "mean": the prompt's final hidden state at its last token,
    # or averaged over its tokens (an Embedding event), and no answer; such a prompt is
    # prefilled whole, never taken from a cache
    embed: str | None = None
    # the answer's expected text as token ids (OpenAI's predicted outputs): drafts come
    # from it too, ahead of the prompt's
    prediction: list[int] | None = None


class RequestHandle:
    """A submitted request: its events, and ``cancel()`` from any thread."""

    def __init__(self, scheduler: Scheduler, request: Request, rid: int):
        self.id = rid
        self.request = request
        self.error: BaseException | None = None  # what broke the request, if anything
        self._scheduler = scheduler
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cancel = threading.Event()
        self._done = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        self._scheduler._ask_cancel(self)

    def _emit(self, event: Event) -> None:
        sink = self.request.sink
        if sink is not None:
            sink(event)
        else:
            self._queue.put(event)
        if isinstance(event, Finished | Failed):
            self._done.set()

    def _next(self) -> Event:
        s = self._scheduler
        while True:
            try:
                return self._queue.get_nowait()
            except queue.Empty:
                pass
            if s._thread is not None:
                return self._queue.get()
            if not s.step() and self._queue.empty():
                raise RuntimeError("the scheduler has nothing to run for an unfinished request")

    def events(self) -> Iterator[Event]:
        """The request's events, blocking; ends after ``Finished`` or ``Failed``. On the
        thread that drives an unstarted scheduler, reading them runs the loop. A caller that
        stops reading early cancels the request."""
        try:
            while True:
                ev = self._next()
                yield ev
                if isinstance(ev, Finished | Failed):
                    return
        finally:
            if not self.done:
                self.cancel()
                if self._scheduler._thread is None:
                    while not self.done and self._scheduler.step():
                        pass


class _Job:
    """A request inside the scheduler."""

    def __init__(self, handle: RequestHandle, policy: KVPolicy):
        req = handle.request
        self.handle = handle
        self.req = req
        self.policy = policy
        self.describe = policy.describe()
        self.ids = list(req.ids)
        self.session = req.session
        self.total = len(self.ids)
        self.caches: list | None = None  # its single-sequence caches (None once batched)
        self.kv: KVAccounting | None = None  # its caches' figures (None once batched)
        self.batch_kv: dict | None = None  # its row's last figures, when it left a batch
        self.cached = self.done = 0  # prompt tokens reused / in the caches
        self.boundary = self.total
        self.finish: FinishRule | None = None
        self.sampler = None
        self.weights = None  # a sampled answer's distribution, where drafts are checked on it
        self.may_draft = False  # whether its steps may check drafts when it decodes alone
        self.processors: list = []
        self.history = None  # the tokens logits processors see
        self.broken: UserError | None = None  # its grammar failed: it ends with this error
        self.scores: list = []  # prompt_logprobs: (logprob, top) per scored prompt token
        self.pooled = None  # embed "mean": the hidden states' sum so far (float32)
        self.next_input: int | None = None  # the first token: shown, not yet fed
        self.pending_lp = None  # logprobs of the token sampled ahead (not yet shown)
        self.started = self.first_token = 0.0
        self.prompt_tps = self.generation_tps = 0.0
        self.group: _Group | None = None
        self.row = 0  # its row in its group's batched caches (set every decode step)
        self.limit_tokens = self.total  # prompt + the most answer tokens (the reservation's)
        self.reserved = 0  # KV bytes reserved for it alone
        self.keep = False  # its caches go to the prefix cache when it ends
        self.fed: list[int] = []  # answer tokens fed to its caches (kept requests)
        self.checkpoint: Checkpoint | None = None  # its caches at the turn boundary
        self.lookup: PromptLookup | None = None  # its tokens, indexed for drafts
        self.draft_length = 0  # drafts its next step checks at most
        self.ahead = 0  # tokens its caches hold after the one being taken (drafts)
        self.drafted = self.accepted = 0  # its draft tokens checked / taken


@dataclass
class _Group:
    key: object
    policy: KVPolicy
    rows: list[_Job] = field(default_factory=list)
    caches: list | None = None  # batched caches once two rows have met
    inputs: object = None  # (rows,) the tokens the next step feeds, sampled a step ahead
    kv_bytes: tuple[int, int, int] | None = None  # (step, actual, predicted) of the batch

    @property
    def held(self) -> list:
        """The caches its rows decode in: the batch's, or a lone row's own."""
        return self.caches if self.caches is not None else self.rows[0].caches


class Scheduler:
    """Runs every request on one model; see the module docstring."""

    def __init__(
        self,
        loaded: LoadedModel,
        policy: KVPolicy | None = None,
        max_batch: int = 16,
        share_prefix: bool = True,
        observer: Callable[[KVPolicy, list], None] | None = None,
        prefill_budget: int = 512,  # prompt tokens a round prefills before it decodes
        prefix_cache=None,  # mlxkv.engine.prefix_cache.PrefixCache: reuse across requests
        memory=None,  # mlxkv.engine.admission.MemoryBudget: admit by KV reservations
        reserve_step: int = RESERVE_STEP,  # an open-ended answer's reservation grows by it
        lockstep=None,  # mlxkv.engine.lockstep.StepExchange: the ranks of a split model
        draft_tokens: int = 0,  # prompt lookup: most drafts a greedy step checks (0: off)
        floor=None,  # mlxkv.engine.pressure.MemoryFloor: the machine's free memory kept up
    ):
        if max_batch < 1:
            raise UserError(f"--max-batch must be at least 1, got {max_batch}")
        if not 0 <= draft_tokens <= MAX_DRAFT_TOKENS:
            raise UserError(
                f"--draft-tokens must be between 0 and {MAX_DRAFT_TOKENS}, got {draft_tokens}"
            )
        self.loaded = loaded
        self.policy = policy or KVPolicy()
        self.max_batch = max_batch
        self.share_prefix = share_prefix
        self.prefill_budget = prefill_budget
        self.observer = observer  # sees every batched decode step's caches (opt-in checks)
        self.prefix = prefix_cache
        self.memory = memory
        self.reserve_step = reserve_step
        self.lockstep = lockstep
        self.draft_tokens = draft_tokens if lockstep is None else 0  # (ranks decide alike)
        self.floor = floor if lockstep is None else None  # (each host's memory differs)
        self.drafted = self.accepted = 0  # draft tokens checked / taken
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: deque[RequestHandle] = deque()  # submitted, not yet seen by a step
        self._arrived: deque[RequestHandle] = deque()  # seen by this step, to admit
        self._cancel_asks: list[RequestHandle] = []  # lockstep: cancels the next step applies
        self.leader_stopped = False  # a follower rank: rank 0 has stopped its loop
        self._waiting: list[_Job] = []
        self._prefilling: _Job | None = None
        self._groups: dict[object, _Group] = {}
        self._policy_errors: dict[KVPolicy, str | None] = {}
        self._batchable: dict[KVPolicy, bool] = {}
        self._prefixes: dict[KVPolicy, SharedPrefixes] = {}
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()  # the thread's loop has ended
        self._closing = False
        self._next_id = 0
        self.steps = 0
        self._heap_trimmed = time.monotonic()  # when the C heap last gave pages back
        self.max_rows_in_a_step = 0
        self.requests_finished = 0
        self.tokens_generated = self.prompt_tokens_prefilled = self.prompt_tokens_cached = 0
        self.refused_too_large = 0
        self._taken = 0  # every token taken so far, hashed: ranks must sample alike
        self._rate: deque[tuple[float, int]] = deque()  # (time, tokens generated) samples
        self._status: dict = self._snapshot()

    # -- the callers' side (any thread) ------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return encode_prompt(self.loaded.tokenizer, text)

    def submit(self, request: Request) -> RequestHandle:
        with self._lock:
            if self._closing:
                raise UserError("the engine is shutting down; no new requests are taken")
            self._next_id += 1
            handle = RequestHandle(self, request, self._next_id)
            self._inbox.append(handle)
        self._wake.set()
        return handle

    def start(self) -> None:
        """Run the loop on a thread of its own (callers then only read events)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mlxkv-scheduler", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Take no new requests; let running ones finish for up to ``timeout`` seconds,
        cancel the rest, and stop the loop."""
        with self._lock:
            self._closing = True
        self._wake.set()
        deadline = time.monotonic() + timeout
        if self._thread is None:
            while not self.idle and time.monotonic() < deadline and self.step():
                pass
        else:
            while not self.idle and time.monotonic() < deadline:
                time.sleep(0.02)
        for handle in self._all_handles():
            handle.cancel()
        if self._thread is None:
            while not self.idle and self.step():
                pass
            self._flush()
        else:
            # Across ranks the loop may wait forever in a collective of a rank that died.
            self._stopped.wait(None if self.lockstep is None else timeout + 5.0)
            self._thread = None

    @property
    def idle(self) -> bool:
        busy = self._inbox or self._arrived or self._waiting or self._prefilling or self._groups
        return not busy

    def follow(self) -> None:
        """A follower rank's loop: run rank 0's steps until rank 0 stops."""
        import mlx.core as mx

        while not self.leader_stopped:
            if not self.step():
                # Idle, as rank 0 is: it waits as long before its next step. MLX's ring
                # backend spins while it waits in a collective, so the later a rank
                # enters the next exchange, the less CPU an idle server burns.
                time.sleep(IDLE_WAIT)
        mx.synchronize()

    def shared_prefix(self, policy: KVPolicy) -> SharedPrefixes | None:
        """The prefix shared by requests under ``policy`` (None until one was shared)."""
        return self._prefixes.get(policy)

    def status(self) -> dict:
        """What runs now (a copy the loop refreshes after every step)."""
        return dict(self._status)

    # -- the loop (the MLX thread) ---------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                worked = self.step()
                if self._closing and self.idle:
                    import mlx.core as mx

                    if self.lockstep is not None:
                        self.lockstep.exchange({"stop": True}, self._digest())
                    self._flush()
                    mx.synchronize()
                    self._stopped.set()
                    # Park rather than end: an MLX thread that has ended makes the
                    # process abort at exit ("terminate called without an active
                    # exception"); a parked daemon thread does not.
                    threading.Event().wait()
                if not worked:
                    self._wake.wait(IDLE_WAIT)
                    self._wake.clear()
        except BaseException as e:  # nothing may wait forever on a dead loop
            for handle in self._all_handles():
                if not handle.done:
                    handle.error = e
                    handle._emit(Failed(f"the engine stopped: {e}", "internal"))
            self._inbox.clear()
            self._arrived.clear()
            self._waiting.clear()
            self._prefilling = None
            self._groups.clear()
            self._stopped.set()
            raise

    def step(self) -> bool:
        """One round: admit, drop cancelled, prefill up to ``prefill_budget`` prompt
        tokens (at least one chunk; several short prompts start in the same round), one
        token per group. Returns False when there was nothing to do."""
        if not self._take_arrivals():
            return False
        self._mind_the_floor()
        self._admit()
        self._drop_cancelled()
        worked, spent = False, 0
        while spent < self.prefill_budget:
            job = self._prefilling
            if job is not None and job.handle.cancelled:
                break  # dropped at the start of the next round
            fed = self._prefill_one()
            if not fed:
                break
            worked, spent = True, spent + fed
        for group in list(self._groups.values()):
            self._guarded(group.rows, lambda g=group: self._decode(g))
            worked = True
        if worked:
            self.steps += 1
            self._fit_prefixes()
            self._give_back()
        self._status = self._snapshot()
        return worked

    def _give_back(self) -> None:
        """Memory freed buffers held, given back to the system: MLX's buffer cache when
        idle, and on Linux the C heap's free pages (when idle, and every HEAP_TRIM_EVERY
        seconds of steady work, where the heap never idles; docs/serve.md has the soak)."""
        now = time.monotonic()
        if self.idle:
            import mlx.core as mx

            mx.clear_cache()
        elif now - self._heap_trimmed < HEAP_TRIM_EVERY:
            return
        release_heap()
        self._heap_trimmed = now

    def _ask_cancel(self, handle: RequestHandle) -> None:
        if self.lockstep is None:
            handle._cancel.set()
        else:  # every rank must drop it at the same step: the next one
            with self._lock:
                self._cancel_asks.append(handle)
        self._wake.set()

    def _take_arrivals(self) -> bool:
        """Move what was submitted and cancelled since the last step into this one (on
        every rank, rank 0's: see :mod:`mlxkv.engine.lockstep`). False: a follower's rank 0
        has stopped."""
        with self._lock:
            arrived, self._inbox = list(self._inbox), deque()
            asks, self._cancel_asks = self._cancel_asks, []
        if self.lockstep is not None:
            arrived, asks = self._exchange(arrived, asks)
            if self.leader_stopped:
                return False
        for handle in asks:
            handle._cancel.set()
        self._arrived.extend(arrived)
        return True

    def _exchange(self, arrived: list[RequestHandle], asks: list[RequestHandle]):
        from mlxkv.engine.lockstep import pack_request, unpack_request

        if self.lockstep.leader:
            for h in arrived:
                s = h.request.settings
                # a draw every rank repeats: the seed travels with the request
                if s.temperature > 0 and s.seed is None:
                    s = replace(s, seed=int.from_bytes(os.urandom(8), "little"))
                # a time limit would end the answer at each rank's own token: tokens alone do
                if s.time_limit is not None:
                    s = replace(s, time_limit=None)
                h.request = replace(h.request, settings=s)
            news = {
                "arrived": [pack_request(h.id, h.request) for h in arrived],
                "cancelled": [h.id for h in asks],
            }
            self.lockstep.exchange(news if arrived or asks else None, self._digest())
            return arrived, asks
        news = self.lockstep.exchange(None, self._digest())
        if news.get("stop"):
            self.leader_stopped = True
            return [], []
        arrived = []
        for d in news.get("arrived", ()):
            rid, fields = unpack_request(d)
            arrived.append(RequestHandle(self, Request(**fields, sink=_drop_event), rid))
        by_id = {h.id: h for h in self._all_handles() + arrived}
        return arrived, [by_id[i] for i in news.get("cancelled", ()) if i in by_id]

    def _digest(self) -> int:
        """What every rank's scheduler must agree on before a step, hashed."""
        import hashlib

        job = self._prefilling
        state = (
            self.steps,
            self.tokens_generated,
            self._taken,
            [j.handle.id for j in self._waiting],
            None if job is None else (job.handle.id, job.done),
            sorted((repr(g.key), [j.handle.id for j in g.rows]) for g in self._groups.values()),
            None if self.prefix is None else (len(self.prefix.entries), self.prefix.nbytes),
        )
        digest = hashlib.blake2b(repr(state).encode(), digest_size=7).digest()
        return int.from_bytes(digest, "little")  # 56 bits: an int64 on the wire

    def _flush(self) -> None:
        """Closing: the kept prefixes go to disk, so a restarted server finds them."""
        if self.prefix is not None:
            self.prefix.flush()

    def _all_handles(self) -> list[RequestHandle]:
        with self._lock:
            handles = list(self._inbox) + list(self._arrived)
        jobs = list(self._waiting)
        if self._prefilling is not None:
            jobs.append(self._prefilling)
        for g in list(self._groups.values()):
            jobs.extend(g.rows)
        return handles + [j.handle for j in jobs]

    def _snapshot(self) -> dict:
        running = []
        kv_actual = kv_predicted = 0
        for g in self._groups.values():
            # a batch's bytes are shared by its rows: each row reports the batch's
            kv_bytes = sum(c.nbytes for c in g.held)
            predicted = self._predicted(g)
            kv_actual += kv_bytes
            kv_predicted += predicted
            for j in g.rows:
                running.append(
                    {
                        "id": j.handle.id,
                        "policy": j.describe,
                        "prompt_tokens": j.total,
                        "prompt_tokens_cached": j.cached,
                        "generated": len(j.finish.tokens) if j.finish else 0,
                        "kv_bytes": kv_bytes,
                        "kv_bytes_predicted": predicted,
                        "reserved_bytes": j.reserved,
                        "batch_rows": len(g.rows),
                    }
                )
        job = self._prefilling
        if job is not None and job.caches is not None:
            kv_actual += sum(c.nbytes for c in job.caches)
            kv_predicted += job.kv.predicted(job.done).allocated if job.kv else 0
        queue = [
            {
                "id": j.handle.id,
                "policy": j.describe,
                "prompt_tokens": j.total,
                "reserved_bytes": j.reserved,
            }
            for j in self._waiting[:50]
        ]
        out = {
            "running": running,
            "prefilling": 0 if self._prefilling is None else 1,
            "waiting": len(self._waiting) + len(self._inbox) + len(self._arrived),
            "queue": queue,
            "groups": [
                {"policy": g.policy.describe(), "rows": len(g.rows)} for g in self._groups.values()
            ],
            "max_rows_in_a_step": self.max_rows_in_a_step,
            "steps": self.steps,
            "requests_finished": self.requests_finished,
            "tokens_generated": self.tokens_generated,
            "prompt_tokens_prefilled": self.prompt_tokens_prefilled,
            "prompt_tokens_cached": self.prompt_tokens_cached,
            "draft_tokens": self.drafted,
            "draft_tokens_accepted": self.accepted,
            "tokens_per_second": self._tokens_per_second(),
            "refused": {"too_large": self.refused_too_large},
        }
        if self.memory is not None or self.prefix is not None:
            out["memory"] = self._memory_status(kv_actual, kv_predicted)
        if self.prefix is not None:
            out["prefix_cache"] = self.prefix.status()
        if self.floor is not None:
            out["machine_memory"] = self.floor.status()
        return out

    def _predicted(self, g: _Group) -> int:
        """The memory model's KV bytes for group ``g`` now."""
        if g.caches is None:
            job = g.rows[0]
            return job.kv.predicted(job.kv.read().tokens_seen).allocated if job.kv else 0
        return self._batch_predicted(g)

    def _batch_predicted(self, g: _Group) -> int:
        """The memory model's bytes of group ``g``'s batched caches now."""
        from mlxkv.memory.predictor import batch_allocated

        c = next((c for c in g.caches if hasattr(c, "n")), None)
        rows_seen = list(c.n) if c is not None else []
        return batch_allocated(self.loaded.kv_layout, g.policy, rows_seen, self.loaded.dtype)

    def _memory_status(self, kv_actual: int, kv_predicted: int) -> dict:
        import mlx.core as mx

        m = self.memory.status() if self.memory is not None else {}
        return {
            "budget_bytes": m.get("budget_bytes"),
            "weights_bytes": m.get("weights_bytes", self.loaded.weights_bytes),
            "runtime_bytes": m.get("runtime_bytes", 0),
            "reserved_bytes": self._reserved(),
            "prefix_cache_bytes": self.prefix.nbytes if self.prefix is not None else 0,
            "kv_bytes_actual": kv_actual,
            "kv_bytes_predicted": kv_predicted,
            "active_bytes": mx.get_active_memory(),
            "peak_bytes": mx.get_peak_memory(),
            "cache_bytes": mx.get_cache_memory(),  # freed buffers MLX keeps for reuse
        }

    def _tokens_per_second(self, span: float = 5.0) -> float:
        now = time.monotonic()
        self._rate.append((now, self.tokens_generated))
        while len(self._rate) > 2 and now - self._rate[1][0] > span:
            self._rate.popleft()
        t0, n0 = self._rate[0]
        return (self.tokens_generated - n0) / (now - t0) if now > t0 else 0.0

    # -- memory admission ----------------------------------------------------------------------
    def _reserved(self, extra: tuple[_Job, ...] = ()) -> int:
        """KV bytes reserved by the running requests (and ``extra`` as if started): a batch
        reserves its rows x its largest reservation (rows are padded to the longest); and
        the turn-boundary copies they hold that no kept prefix counts."""
        if self.memory is None:
            return sum(j.reserved for g in self._groups.values() for j in g.rows)
        groups: dict[object, tuple[KVPolicy, list[int]]] = {}
        for g in self._groups.values():
            groups[g.key] = (g.policy, [j.limit_tokens for j in g.rows])
        alone = []
        if self._prefilling is not None:
            alone.append(self._prefilling)
        alone.extend(extra)
        total = 0
        for job in alone:
            total += self._scoring(job)  # a scored prefill holds every position's logits
            key = self._group_key(job)
            if key in groups:
                groups[key][1].append(job.limit_tokens)
            else:
                total += job.reserved
        for policy, limits in groups.values():
            total += self.memory.reservation(policy, max(limits), len(limits))
        return total + self._held_copies()

    def _held_copies(self) -> int:
        """Bytes of the turn-boundary copies running requests hold outside the prefix cache
        (a copy is a cache's worth once its request writes past it)."""
        kept = {id(e.checkpoint) for e in self.prefix.entries} if self.prefix else set()
        jobs = [j for g in self._groups.values() for j in g.rows] + [self._prefilling]
        return sum(
            j.checkpoint.nbytes
            for j in jobs
            if j is not None and j.checkpoint is not None and id(j.checkpoint) not in kept
        )

    def _scoring(self, job: _Job) -> int:
        if job.req.prompt_logprobs is None or self.memory is None:
            return 0
        return self.memory.scoring(job.total, job.req.settings.prefill_step)

    def _fits(self, *jobs: _Job) -> bool:
        """Whether ``jobs`` may start now under the memory budget (none: whether what runs
        fits, after a reservation grew); kept prefixes are evicted to make room before they
        wait."""
        m = self.memory
        if m is None or m.budget is None:
            return True
        if jobs and not self._machine_has_room(jobs):
            return False  # the machine is short of memory: it waits for the running ones
        over = m.base() + self._reserved(extra=jobs) - m.budget
        kept = self.prefix.nbytes if self.prefix is not None else 0
        if over + kept <= 0:
            return True
        if self.prefix is not None and over <= 0:
            self.prefix.make_room(over + kept)
            return True
        return False  # it waits for running requests; evicting prefixes now would not help

    def _mind_the_floor(self) -> None:
        """When a new reading finds the machine's free memory under the floor, give back
        what is held only for later until the shortfall is covered: MLX's freed buffers,
        then kept prefixes (to disk), least recently used first."""
        f = self.floor
        if f is None or not f.read():
            return
        room = f.room()
        if room is None or room >= 0:
            f.note()
            return
        import mlx.core as mx

        given = mx.get_cache_memory()  # MLX's freed buffers first
        mx.clear_cache()
        prefixes = 0
        if self.prefix is not None and -room > given:
            before = len(self.prefix.entries)
            given += self.prefix.make_room(-room - given)
            prefixes = before - len(self.prefix.entries)
            mx.clear_cache()
        release_heap()
        f.gave_back(given)
        kept = ""
        if prefixes:
            disk = self.prefix.disk
            to = "to disk" if disk is not None and disk.writable else "dropped"
            kept = f"{prefixes} kept prefix{'es' if prefixes > 1 else ''} {to} and "
        f.note(f"gave back {human_bytes(given)} ({kept}MLX's freed buffers)")

    def _machine_has_room(self, jobs: tuple[_Job, ...]) -> bool:
        """Whether ``jobs`` may start beside the running requests on this machine: the KV
        all their reservations have yet to allocate fits in its free memory above the
        floor. Alone, a request starts (the budget decides), so none waits forever."""
        if self.floor is None or self.memory is None:
            return True
        if not (self._groups or self._prefilling):
            return True
        held = sum(c.nbytes for g in self._groups.values() for c in g.held)
        if self._prefilling is not None and self._prefilling.caches is not None:
            held += sum(c.nbytes for c in self._prefilling.caches)
        return self._above_floor(self._reserved(extra=jobs) - held)

    def _above_floor(self, need: int, shed: bool = True) -> bool:
        """Whether ``need`` more bytes fit in the machine's free memory above the floor
        (with ``shed``, kept prefixes give way first)."""
        room = self.floor.room() if self.floor is not None else None
        if room is None or need <= room:
            return True
        if shed and self.prefix is not None:
            freed = self.prefix.make_room(need - room)
            self.floor.gave_back(freed)
            room += freed
        return need <= room

    def _fit_prefixes(self) -> None:
        """Kept prefixes give way to the budget: a finished request's entry (its caches and
        a turn-boundary copy) can outgrow the reservation its end frees."""
        m = self.memory
        if self.prefix is None or m is None or m.budget is None:
            return
        over = m.base() + self._reserved() + self.prefix.nbytes - m.budget
        if over > 0:
            self.prefix.make_room(over)

    # -- admission ---------------------------------------------------------------------------
    def _admit(self) -> None:
        from mlxkv.memory.context import past_trained_context
        from mlxkv.models.head import head_split, no_hidden_states

        while True:
            if not self._arrived:
                return
            handle = self._arrived.popleft()
            req = handle.request
            policy = req.policy or self.policy
            if handle.cancelled:
                self._end(_Job(handle, policy), "cancelled")
                continue
            if not req.ids:
                self._fail(handle, "the prompt is empty", "invalid_request")
                continue
            why = self._policy_error(policy)
            if why is not None:
                self._fail(handle, why, "invalid_policy")
                continue
            if req.embed and not head_split(self.loaded.model):
                self._fail(handle, no_hidden_states(self.loaded.model), "embeddings_unsupported")
                continue
            limit = self.loaded.context_length
            if past_trained_context(limit, policy.window, len(req.ids) + 1):
                self._fail(
                    handle,
                    f"the prompt has {len(req.ids)} tokens but the model's context is {limit}; "
                    "shorten it or use a window (--kv-window)",
                    "context_length_exceeded",
                )
                continue
            try:  # a grammar is compiled here: one it cannot use fails the request alone
                processors = processors_for(req.settings, req.ids, self.loaded.tokenizer)
            except UserError as e:
                self._fail(handle, str(e), "invalid_grammar")
                continue
            job = _Job(handle, policy)
            job.processors = processors
            want = req.settings.max_tokens
            if req.settings.open_ended:
                want = min(want, self.reserve_step)
            new, _ = token_budget(limit, policy.window, job.total, want)
            job.limit_tokens = job.total + new
            if self.memory is not None:
                job.reserved = self.memory.reservation(policy, job.limit_tokens)
                why = self.memory.never_fits(policy, job.total, new, self._scoring(job))
                if why is not None:
                    self.refused_too_large += 1
                    self._fail(handle, why, "kv_budget")
                    continue
            self._waiting.append(job)

    def _policy_error(self, policy: KVPolicy) -> str | None:
        if policy not in self._policy_errors:
            from mlxkv.caches import check_policy

            try:
                check_policy(self.loaded.model, policy)
                self._policy_errors[policy] = None
            except UserError as e:
                self._policy_errors[policy] = str(e)
        return self._policy_errors[policy]

    def _fail(self, handle: RequestHandle, message: str, code: str) -> None:
        handle._emit(Failed(message, code))
        self.requests_finished += 1

    def _batchable_policy(self, policy: KVPolicy) -> bool:
        if policy not in self._batchable:
            from mlxkv.caches import make_caches
            from mlxkv.caches.batched import batched_form

            why = batched_form(make_caches(self.loaded.model, policy))
            self._batchable[policy] = why is None
        return self._batchable[policy]

    def _group_key(self, job: _Job) -> object:
        if job.session is not None or not self._batchable_policy(job.policy):
            return ("alone", job.handle.id)
        return ("policy", job.policy)

    def _has_room(self, job: _Job) -> bool:
        if job.req.embed:
            return True  # an embedding ends with its prefill: it never joins a group
        g = self._groups.get(self._group_key(job))
        return g is None or len(g.rows) < self.max_batch

    # -- cancels and failures ------------------------------------------------------------------
    def _drop_cancelled(self) -> None:
        for job in [j for j in self._waiting if j.handle.cancelled]:
            self._waiting.remove(job)
            self._end(job, "cancelled")
        job = self._prefilling
        if job is not None and job.handle.cancelled:
            self._prefilling = None
            self._end(job, "cancelled")
        for g in list(self._groups.values()):
            gone = [j for j in g.rows if j.handle.cancelled]
            if gone:
                self._guarded(g.rows, lambda g=g, gone=gone: self._leave(g, gone, "cancelled"))

    def _guarded(self, jobs: list[_Job], work: Callable[[], None]) -> None:
        """Run ``work``; if it raises, the jobs it touched fail (their sessions drop what
        their caches half-hold) and the error goes to each; interrupts propagate."""
        try:
            work()
        except BaseException as e:
            for job in list(jobs):
                self._discard(job)
                if job.session is not None:
                    job.session.recover(in_model=True)
                job.handle.error = e
                self._fail(job.handle, first_line(e), "internal")
            if not isinstance(e, Exception):
                raise

    def _discard(self, job: _Job) -> None:
        """Take ``job`` out of wherever it is; a failed step fails its whole batch."""
        if job in self._waiting:
            self._waiting.remove(job)
        if self._prefilling is job:
            self._prefilling = None
        g = job.group
        if g is not None:
            self._groups.pop(g.key, None)
            job.group = None

    # -- prefill -------------------------------------------------------------------------------
    def _prefill_one(self) -> int:
        """One prefill chunk of the oldest request whose group has room; returns the
        prompt tokens it fed (at least 1 when it did any work, 0 when none was waiting)."""
        job = self._prefilling
        if job is None:
            job = next((j for j in self._waiting if self._has_room(j)), None)
            if job is None or not self._fits(job):
                return 0  # the oldest that could run waits for memory: so do the others
            if self._in_one_call(job):
                return self._embed_together(job)
            self._waiting.remove(job)
            self._prefilling = job
            self._guarded([job], lambda: self._start(job))
            if self._prefilling is not job:
                return 1
        before = job.done
        self._guarded([job], lambda: self._prefill_chunk(job))
        return max(job.done - before, 1)

    def _start(self, job: _Job) -> None:
        """Give ``job`` its caches (reusing what its session or a shared prefix holds)."""
        s = job.req.settings
        job.started = time.perf_counter()
        if job.session is not None:
            job.cached = job.done = job.session.prepare(job.ids)
            job.caches, job.kv = job.session.caches, job.session.kv
            if job.session.needs_checkpoint:
                job.boundary = job.total - 1
                if job.done == job.boundary:
                    job.session.take_checkpoint()
        else:
            held, caches = 0, None
            whole = job.req.prompt_logprobs is not None or job.req.embed  # every token
            if self.prefix is not None and self._batchable_policy(job.policy) and not whole:
                job.keep = True
                job.boundary = job.total - 1  # the boundary copy, then the last token alone
                held, caches = self.prefix.take(job.policy, job.ids)
            if caches is not None:
                job.caches, job.done = caches, held
                job.cached = held
                self.prompt_tokens_cached += held
                if held == job.boundary:
                    self._boundary(job)
            else:
                job.caches, job.done = self._fresh_caches(job)
                job.cached = 0  # a shared prefix counts as prefilled for each request in it
                self.prompt_tokens_prefilled += job.done
            job.kv = KVAccounting(self.loaded, job.policy, job.caches)
        self._release_shared_prefixes()
        job.sampler = sampler_for(s, self.loaded.tokenizer)
        job.weights = sampling_weights_for(s, self.loaded.tokenizer)
        # greedy or sampled from a distribution drafts can be checked on, its logits
        # processors able to see drafts (see _shows_drafts)
        job.may_draft = (job.sampler is None or job.weights is not None) and all(
            _shows_drafts(p) for p in job.processors
        )
        max_tokens, capped = token_budget(
            self.loaded.context_length, job.policy.window, job.total, s.max_tokens
        )
        job.finish = FinishRule(
            self.loaded.tokenizer,
            s.stop,
            max_tokens,
            capped,
            after=tuple(job.ids[-1:]) if s.continues else (),
            min_tokens=s.min_tokens,
            min_indent=s.min_indent,
            time_limit=s.time_limit,
        )

    def _boundary(self, job: _Job) -> None:
        """``job``'s caches hold its prompt but the last token: keep a copy (the turn
        boundary a bounded cache goes back to), and offer it to requests that start while
        this one decodes."""
        from mlxkv.caches import always_exact, copy_caches, snapshot
        from mlxkv.engine.reuse import state_bytes

        tokens = job.ids[:-1]
        need = self._counted(sum(c.nbytes for c in job.caches))
        if not all(always_exact(c) for c in job.caches):
            if not self._room_for_a_copy(need):
                return  # no room for its copy: its next turn prefills what it cannot trim
            states = snapshot(job.caches)
            job.checkpoint = Checkpoint(list(tokens), states, self._counted(state_bytes(states)))
        if job.cached < len(tokens) and self._room_for_a_copy(need):
            self.prefix.put(job.policy, tokens, copy_caches(job.caches), job.checkpoint)

    def _counted(self, nbytes: int) -> int:
        """Bytes this rank holds, as admission counts them: across the ranks of a split
        model, the largest rank's (their shares differ when split by layers), so that every
        rank takes the same decisions."""
        return nbytes if self.lockstep is None else self.lockstep.largest(nbytes)

    def _room_for_a_copy(self, need: int) -> bool:
        """Whether a copy of a request's caches (``need`` bytes) may be kept beside it: the
        copy shares their buffers until the next write, then costs their bytes again, on
        top of the reservations (a finished request's caches, kept at its end, come out of
        its own)."""
        m = self.memory
        if m is None or m.budget is None:
            return True
        free = m.budget - m.base() - self._reserved() - self.prefix.nbytes
        if need > free:
            free += self.prefix.make_room(need - free)
        return need <= free and self._above_floor(need, shed=False)

    def undo_reserve(self, policy: KVPolicy) -> int:
        """Tokens a window cache keeps an undo log for, so that drafts it rejects after it
        has evicted come out exactly (a draft step feeds ``draft_tokens`` and the token
        before them, and gives back at most the drafts). KIVI keys keep none: their drafts
        are checked only inside the group being filled."""
        if not self.draft_tokens or policy.window is None or uses_kivi(policy):
            return 0
        return self.draft_tokens

    def _fresh_caches(self, job: _Job) -> tuple[list, int]:
        from mlxkv.caches import make_caches

        model, policy = self.loaded.model, job.policy

        def new():  # holds no request: the shared prefix outlives the one that made it
            return make_caches(model, policy, reserve=self.undo_reserve(policy))

        if job.req.prompt_logprobs is not None or job.req.embed:  # every token goes through
            return new(), 0
        if not (self.share_prefix and self._batchable_policy(job.policy)):
            return new(), 0
        prefixes = self._prefixes.setdefault(job.policy, SharedPrefixes(new))
        others = [j.ids for j in self._waiting if j.policy == job.policy]
        step = job.req.settings.prefill_step
        from mlxkv.caches import copy_caches

        held, caches = prefixes.lookup(
            job.ids, others, lambda c, ids, a, b: prefill(self.loaded.model, c, ids, a, b, step)
        )
        return (new(), 0) if caches is None else (copy_caches(caches), held)

    def _release_shared_prefixes(self) -> None:
        """A shared prefix serves the requests waiting now, outside every reservation: one
        that no waiting request can use is let go (a policy per request must not pin one)."""
        waiting = {j.policy for j in self._waiting}
        for policy, shared in self._prefixes.items():
            if policy not in waiting:
                shared.release()

    def _prefill_chunk(self, job: _Job) -> None:
        """Feed the next prompt chunk; the last one gives the first answer token."""
        import mlx.core as mx

        from mlxkv.caches import prefill_chunk

        if job.done >= job.boundary:  # only the prompt's last token is left
            n = job.total - job.done
        else:
            n = min(
                prefill_chunk(job.caches, job.req.settings.prefill_step), job.boundary - job.done
            )
        last = job.done + n == job.total
        chunk = job.ids[job.done : job.done + n]
        logits = pooled = None
        if job.req.embed:
            pooled = self._pool(job, chunk, last)
        elif job.req.prompt_logprobs is not None:
            logits = self._score(job, chunk, last)
        else:
            logits = feed(self.loaded.model, job.caches, mx.array(chunk), logits=last)
        if job.session is not None:
            job.session.tokens.extend(chunk)
        job.done += n
        self.prompt_tokens_prefilled += n
        if job.session is not None and job.done == job.total - 1 and job.session.needs_checkpoint:
            job.session.take_checkpoint()
        if job.keep and job.done == job.total - 1:
            self._boundary(job)
        job.handle._emit(
            PrefillProgress(job.done - job.cached, job.total - job.cached, self._stats(job))
        )
        if not last:
            return
        self._prefilling = None
        now = time.perf_counter()
        job.first_token = now
        if now > job.started:
            job.prompt_tps = (job.total - job.cached) / (now - job.started)
        job.history = processor_history(job.ids, job.req.settings) if job.processors else None
        if pooled is not None:  # an embedding: no answer
            job.handle._emit(Embedding(tuple(pooled.tolist())))
            self._end(job, "stop")
            return
        if job.req.prompt_logprobs is not None:
            lps, top = zip(*job.scores, strict=True) if job.scores else ((), ())
            job.handle._emit(PromptLogprobs(tuple(job.ids), lps, top))
        tokens, lps = self._sample([job], logits)
        if job.broken is not None:
            self._fail(job.handle, str(job.broken), "invalid_grammar")
            return
        token = tokens.item()
        job.next_input = token
        if not self._take_token(job, token, _resolve(lps[0])):
            self._join(job)

    def _score(self, job: _Job, chunk: list[int], last: bool):
        """Feed ``chunk`` with the logits of every position: each scores the prompt's next
        token (kept in ``job.scores``); returns the last position's logits when ``last``."""
        import mlx.core as mx

        out = self.loaded.model(mx.array(chunk)[None], cache=job.caches)[0]
        nxt = job.ids[job.done + 1 : job.done + len(chunk) + 1]  # the tokens they predict
        tail = out[-1:] if last else None
        if not nxt:  # a last chunk of one token predicts the answer alone
            mx.eval([c.state for c in job.caches], *([tail] if last else []))
            return tail
        lps = out[: len(nxt)].astype(mx.float32)
        lps = lps - mx.logsumexp(lps, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(lps, mx.array(nxt)[:, None], axis=-1)[:, 0]
        k = min(job.req.prompt_logprobs, lps.shape[-1])
        best = mx.zeros((len(nxt), 0), mx.int32)
        if k:  # the k best of each position (a partition, then those k sorted), best first
            best = mx.argpartition(-lps, kth=k - 1, axis=-1)[:, :k]
            order = mx.argsort(-mx.take_along_axis(lps, best, axis=-1), axis=-1)
            best = mx.take_along_axis(best, order, axis=-1)
        best_lp = mx.take_along_axis(lps, best, axis=-1)
        mx.eval(chosen, best, best_lp, [c.state for c in job.caches], *([tail] if last else []))
        rows = zip(chosen.tolist(), best.tolist(), best_lp.tolist(), strict=True)
        for lp, ids, vals in rows:
            job.scores.append((lp, tuple(zip(ids, vals, strict=True))))
        return tail

    @staticmethod
    def _in_one_call(job: _Job) -> bool:
        """Whether ``job`` is an embedding input that one prompt chunk takes whole."""
        return bool(job.req.embed) and job.total <= job.req.settings.prefill_step

    def _embed_together(self, first: _Job) -> int:
        """Embed ``first`` with the waiting inputs :meth:`_pack` puts beside it, in one
        model call; returns the tokens fed."""
        batch = self._pack(first)
        for job in batch:
            self._waiting.remove(job)
        started, vectors = time.perf_counter(), []
        self._guarded(batch, lambda: vectors.extend(self._embed_rows(batch)))
        now = time.perf_counter()
        for job, vector in zip(batch, vectors, strict=False):  # none if the call failed
            job.started, job.first_token, job.done = started, now, job.total
            job.prompt_tps = job.total / (now - started) if now > started else 0.0
            self.prompt_tokens_prefilled += job.total
            job.handle._emit(PrefillProgress(job.total, job.total, self._stats(job)))
            job.handle._emit(Embedding(tuple(vector)))
            self._end(job, "stop")
        return sum(j.total for j in batch)

    def _pack(self, first: _Job, padding: float = EMBED_PADDING) -> list[_Job]:
        """``first`` and the waiting inputs that fit beside it in one model call, those
        nearest its length first: rows padded to the longest, rows x longest within each
        one's prefill step (the call costs what one prompt chunk does, and later inputs go
        ahead of older answers by at most that) and at most ``padding`` of it padding (a
        padded token costs what a real one does; a call saved, one read of the weights:
        docs/serve.md measures the alternatives). Each must fit the memory budget beside
        the others."""
        others = [j for j in self._waiting if j is not first and self._in_one_call(j)]
        batch = [first]
        for job in sorted(others, key=lambda j: abs(j.total - first.total)):
            rows = [*batch, job]
            step = min(j.req.settings.prefill_step for j in rows)
            cells = len(rows) * max(j.total for j in rows)
            if cells > step or cells - sum(j.total for j in rows) > padding * cells:
                continue
            if not self._fits(*rows):
                break
            batch = rows
        return batch

    def _embed_rows(self, batch: list[_Job]) -> list[list[float]]:
        """One call of the model's body over ``batch``'s inputs, right-padded (causal
        attention keeps each row's tokens from seeing its padding, so its states are those
        of its input alone), each row pooled as its request asks."""
        import mlx.core as mx

        from mlxkv.models.head import hidden_states

        longest = max(j.total for j in batch)
        ids = mx.array([j.ids + [0] * (longest - j.total) for j in batch])
        h = hidden_states(self.loaded.model, ids, None).astype(mx.float32)
        lengths = mx.array([j.total for j in batch])
        inside = (mx.arange(longest)[None] < lengths[:, None])[..., None]
        mean = mx.where(inside, h, 0).sum(axis=1) / lengths[:, None]
        last = h[mx.arange(len(batch)), lengths - 1]
        wants_mean = mx.array([j.req.embed == "mean" for j in batch])[:, None]
        return mx.where(wants_mean, mean, last).tolist()

    def _pool(self, job: _Job, chunk: list[int], last: bool):
        """Feed ``chunk`` through the model's body (no output head) and pool its final
        hidden states as ``job.req.embed`` asks, in float32 (a sum over thousands of tokens
        would round in bfloat16); returns the pooled vector after the last chunk."""
        import mlx.core as mx

        from mlxkv.models.head import hidden_states

        h = hidden_states(self.loaded.model, mx.array(chunk)[None], job.caches)[0]
        if job.req.embed == "mean":
            total = h.astype(mx.float32).sum(axis=0)
            job.pooled = total if job.pooled is None else job.pooled + total
            out = job.pooled / job.total if last else job.pooled
        else:
            out = h[-1].astype(mx.float32) if last else None
        mx.eval([c.state for c in job.caches], *([] if out is None else [out]))
        return out if last else None

    # -- decode --------------------------------------------------------------------------------
    def _join(self, job: _Job) -> None:
        import mlx.core as mx

        from mlxkv.caches.batched import merge_rows

        key = self._group_key(job)
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = _Group(key, job.policy)
        elif g.caches is None:  # a lone row meets a second: they become a batch
            g.caches = merge_rows([g.rows[0].caches, job.caches])
            g.rows[0].caches = g.rows[0].kv = None  # the batch holds copies of them
            job.caches = job.kv = None
        else:
            for i, c in enumerate(g.caches):
                c.extend_rows([job.caches[i]])
            job.caches = job.kv = None
        job.group = g
        g.rows.append(job)
        first = mx.array([job.next_input])
        g.inputs = first if g.inputs is None else mx.concatenate([g.inputs, first])

    def _decode(self, g: _Group) -> None:
        """One step, a token ahead (as mlx-lm's generate_step): feed the tokens sampled
        last step and sample the next ones, start that on the device, and only then read
        the tokens just fed and tell their callers, while the device computes. So a token
        is shown when it is fed, and an answer's last token is in its caches."""
        import mlx.core as mx

        if self._drafts_for(g) and self._draft_step(g):
            return
        rows = list(g.rows)
        caches = g.held
        inputs = g.inputs
        logits = self.loaded.model(inputs[:, None], cache=caches)[:, -1, :]
        for i, r in enumerate(rows):
            if r.processors:  # they see the token fed, like mlx-lm's generate_step
                r.history = mx.concatenate([r.history, inputs[i : i + 1]])
        sampled, lps = self._sample(rows, logits)
        mx.async_eval(sampled, *[x for lp in lps if lp is not None for x in lp])
        fed = inputs.tolist()
        self.max_rows_in_a_step = max(self.max_rows_in_a_step, len(rows))
        if g.caches is not None and self.observer is not None:
            self.observer(g.policy, g.caches)
        g.inputs = sampled
        ended = []
        for i, (r, token, lp) in enumerate(zip(rows, fed, lps, strict=True)):
            r.row = i
            if r.session is not None:
                r.session.tokens.append(token)
            if r.keep:
                r.fed.append(token)
            shown, r.pending_lp = r.pending_lp, lp
            if r.next_input is not None:  # the first token was shown when it was sampled
                r.next_input = None
                continue
            if r.broken is None and self._take_token(r, token, _resolve(shown)):
                ended.append(r)
        broken = [r for r in rows if r.broken is not None]  # take_token skipped them
        if ended or broken:
            self._drop_rows(g, ended + broken)
        for r in broken:
            self._fail(r.handle, str(r.broken), "invalid_grammar")

    def _drafts_for(self, g: _Group) -> bool:
        """Whether ``g`` may check drafts: a lone row on its own caches that may draft."""
        if not self.draft_tokens or g.caches is not None or len(g.rows) != 1:
            return False
        return g.rows[0].may_draft

    def _draft_step(self, g: _Group) -> bool:
        """One step that feeds the token sampled last step and, after it, the tokens that
        followed the same last tokens earlier in the conversation; the model's logits at
        each position keep the drafts it agrees with and give the next token
        (:mod:`mlxkv.engine.speculative`). The caches are trimmed to the tokens taken, so
        they hold what plain steps would have fed.
        False (nothing done) when there is no draft or the caches could not give the
        rejected ones back."""
        import mlx.core as mx

        from mlxkv.caches import trim_caches, trimmable_after

        r = g.rows[0]
        first = r.next_input is not None  # its token was shown when it was sampled
        t = r.next_input if first else g.inputs.item()
        if r.lookup is None:  # its first step that may draft
            r.lookup = PromptLookup(r.ids, r.req.prediction or ())
            r.draft_length = self.draft_tokens
        shown = r.finish.tokens
        r.lookup.follow(shown)  # (t, when not shown yet, is the pending token)
        held = r.total + len(shown) - (1 if first else 0)  # tokens in its caches now
        most = min(
            self.draft_tokens,
            r.limit_tokens - held - 1,  # its reservation
            r.finish.max_tokens - len(shown) - (0 if first else 1),  # past it: wasted
        )
        if most <= 0:
            return False
        pending = () if first else (t,)

        def guess(after: tuple[int, ...], n: int) -> list[int]:
            return r.lookup.draft(min(r.draft_length, n), pending + after)

        grammar = next((p for p in r.processors if hasattr(p, "drafts")), None)
        try:  # a grammar drafts what it forces, then the guesses it allows
            drafts = guess((), most) if grammar is None else grammar.drafts(t, guess, most)
        except UserError:
            return False  # a broken grammar: the plain step fails the answer
        if not drafts or trimmable_after(r.caches, len(drafts) + 1) < len(drafts):
            return False
        logits = self.loaded.model(mx.array([[t, *drafts]]), cache=r.caches)[0]
        if r.processors:  # each position's logits as a plain step there would see them
            seen = mx.concatenate([r.history, mx.array([t, *drafts], dtype=r.history.dtype)])
            base = r.history.shape[0] + 1
            rows = []
            try:
                for i in range(len(drafts) + 1):
                    row = logits[i : i + 1]
                    for p in r.processors:
                        row = p(seen[: base + i], row)
                    rows.append(row)
            except UserError as e:  # its grammar broke: it fails, as in a plain step
                self._drop_rows(g, [r])
                self._fail(r.handle, str(e), "invalid_grammar")
                return True
            logits = mx.concatenate(rows)
        if r.weights is None:
            taken, after = check_greedy(logits, drafts)
        else:
            taken, after = check_sampled(r.weights(logits), drafts)
        trim_caches(r.caches, len(drafts) - taken)
        if r.processors:
            r.history = seen[: base + taken]
            for p in r.processors:
                if hasattr(p, "rollback"):  # it read every draft: forget those not kept
                    p.rollback(len(drafts) - taken)
        self.drafted += len(drafts)
        self.accepted += taken
        r.drafted += len(drafts)
        r.accepted += taken
        r.draft_length = adapt_draft_length(r.draft_length, taken, len(drafts), self.draft_tokens)
        self.max_rows_in_a_step = max(self.max_rows_in_a_step, 1)
        g.inputs = mx.array([after])
        r.row = 0
        fed = [t, *drafts[:taken]]
        # logprobs where asked: t's from the step that sampled it, then each position's
        lps = [r.pending_lp] + [None] * (taken + 1)
        if r.req.logprobs is not None:
            kept = logits[: taken + 1]
            kept = kept - mx.logsumexp(kept, axis=-1, keepdims=True)
            for j, token in enumerate([*drafts[:taken], after]):
                lps[j + 1] = _top_logprobs(kept[j], token, r.req.logprobs)
        r.pending_lp = lps[-1]
        for i, token in enumerate(fed):
            if r.session is not None:
                r.session.tokens.append(token)
            if r.keep:
                r.fed.append(token)
            if i == 0 and first:
                r.next_input = None
                continue
            r.ahead = len(fed) - 1 - i
            if self._take_token(r, token, _resolve(lps[i])):
                self._drop_rows(g, [r])
                break
        r.ahead = 0
        return True

    def _sample(self, rows: list[_Job], logits):
        """The next token of each row (and its logprobs where asked), from ``logits``
        (B, vocab) after each row's logits processors."""
        import mlx.core as mx

        if any(r.processors for r in rows):
            parts = []
            for i, r in enumerate(rows):
                row = logits[i : i + 1]
                try:
                    for p in r.processors:
                        row = p(r.history, row)
                except UserError as e:  # this row's grammar broke: it alone fails
                    r.broken, row = e, logits[i : i + 1]
                parts.append(row)
            logits = mx.concatenate(parts, axis=0)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.argmax(logprobs, axis=-1)
        sampled = [(i, r.sampler(logprobs[i : i + 1])) for i, r in enumerate(rows) if r.sampler]
        if sampled:
            idx = mx.array([i for i, _ in sampled])
            picked[idx] = mx.concatenate([t.reshape(-1) for _, t in sampled])
        lps: list = [None] * len(rows)  # lazy (chosen, best ids, best logprobs) where asked
        for i, r in enumerate(rows):
            if r.req.logprobs is not None:
                lps[i] = _top_logprobs(logprobs[i], picked[i], r.req.logprobs)
        return picked, lps

    def _take_token(self, job: _Job, token: int, lp) -> bool:
        """Record ``token`` for ``job`` and tell its caller; True when the answer ended."""
        delta, reason = job.finish.add(token)
        self.tokens_generated += 1
        self._taken = (self._taken * 1_000_003 + token + 1) % (1 << 61)
        n = len(job.finish.tokens)
        if reason is None and job.total + n >= job.limit_tokens and not self._grow(job):
            reason = "length"  # an open-ended answer whose memory ran out ends here
        if n > 1:
            job.generation_tps = (n - 1) / max(time.perf_counter() - job.first_token, 1e-9)
        if reason not in ("stop", "stop_string", "indent"):  # (a token cut from the answer)
            logprob, top = lp if lp is not None else (None, None)
            stats = self._stats(job)
            job.handle._emit(TokenDelta(delta, token, stats, logprob, top))
        if reason is not None:
            if job.ahead:  # drafts fed after this token: the caches end with it
                from mlxkv.caches import trim_caches

                trim_caches(job.caches, job.ahead)
                job.ahead = 0
            self._end(job, reason)
            return True
        return False

    def _grow(self, job: _Job) -> bool:
        """Reserve ``reserve_step`` more answer tokens for an open-ended answer that has
        used its reservation, if the budget has room (kept prefixes give way)."""
        if not job.req.settings.open_ended:
            return True  # its reservation covers its max_tokens
        before = job.limit_tokens, job.reserved
        job.limit_tokens = min(
            job.limit_tokens + self.reserve_step, job.total + job.finish.max_tokens
        )
        if self.memory is not None:
            job.reserved = self.memory.reservation(job.policy, job.limit_tokens)
        if self._fits():
            return True
        job.limit_tokens, job.reserved = before
        return False

    def _leave(self, g: _Group, jobs: list[_Job], reason: str) -> None:
        self._drop_rows(g, jobs)
        for job in jobs:
            self._end(job, reason)

    def _drop_rows(self, g: _Group, jobs: list[_Job]) -> None:
        import mlx.core as mx

        for i, r in enumerate(g.rows):
            if r in jobs and g.caches is not None:  # its figures as it leaves the batch
                r.row = i
                r.batch_kv = self._batch_kv(g, r)
            if r in jobs and r.keep:
                self._keep(r, r.caches if g.caches is None else _split(g.caches, i))
        keep = [i for i, r in enumerate(g.rows) if r not in jobs]
        if g.caches is not None and keep:
            for c in g.caches:
                c.filter(keep)
        if g.inputs is not None and keep:
            g.inputs = g.inputs[mx.array(keep)]
        g.rows = [g.rows[i] for i in keep]
        for job in jobs:
            job.group = None
        if not g.rows:
            del self._groups[g.key]

    def _end(self, job: _Job, reason: str) -> None:
        """Close ``job``'s answer: its session's caches get a first token they were not fed
        yet (decode steps feed every other), the caller the rest of the text and the
        ``Finished`` event."""
        import mlx.core as mx

        if job.keep and job.group is None and job.caches is not None:  # ended before joining
            self._keep(job, job.caches)
        if job.session is not None and job.next_input is not None and job.caches is not None:
            feed(self.loaded.model, job.caches, mx.array([job.next_input]))
            job.session.tokens.append(job.next_input)
        job.next_input = None
        rest, text = job.finish.end(reason) if job.finish else ("", "")
        final = job.finish.reason if job.finish else reason
        stats = replace(self._stats(job), finish_reason=final)
        if rest:
            job.handle._emit(TokenDelta(rest, -1, stats))
        job.handle._emit(Finished(text, final, stats, job.finish.matched if job.finish else None))
        self.requests_finished += 1

    def _keep(self, job: _Job, caches: list) -> None:
        """Offer a finished request's caches (every token fed) to the prefix cache."""
        import mlx.core as mx

        from mlxkv.engine.kv_stats import read_caches

        job.keep = False
        tokens = job.ids + job.fed
        if read_caches(caches).tokens_seen != len(tokens):
            return  # out of step (never expected): not worth keeping
        mx.eval([c.state for c in caches])
        self.prefix.put(job.policy, tokens, caches, job.checkpoint)

    def _stats(self, job: _Job) -> Stats:
        stats = Stats(
            prompt_tokens=job.total,
            prompt_tokens_cached=job.cached,
            generation_tokens=len(job.finish.tokens) if job.finish else 0,
            prompt_tps=job.prompt_tps,
            generation_tps=job.generation_tps,
            context_limit=self.loaded.context_length,
            policy=job.describe,
            draft_tokens=job.drafted,
            draft_tokens_accepted=job.accepted,
        )
        g = job.group
        if g is not None and g.caches is not None:
            return replace(stats, **self._batch_kv(g, job))
        if job.kv is not None:
            return job.kv.snapshot(stats)
        return replace(stats, **job.batch_kv) if job.batch_kv else stats

    def _batch_kv(self, g: _Group, job: _Job) -> dict:
        """A batched row's KV figures: its own token counters, the bytes of the whole batch."""
        import mlx.core as mx

        c = next((c for c in g.caches if hasattr(c, "n")), None)
        seen = c.n[job.row] if c is not None and job.row < len(c.n) else 0
        limit = c.limit if c is not None else None
        kept = seen if limit is None else min(seen, limit)
        if g.kv_bytes is None or g.kv_bytes[0] != self.steps:  # once per step, not per row
            predicted = self._batch_predicted(g)
            g.kv_bytes = (self.steps, sum(x.nbytes for x in g.caches), predicted)
        _, actual, predicted = g.kv_bytes
        return dict(
            kv_tokens=kept,
            kv_evicted=seen - kept,
            kv_tokens_seen=seen,
            kv_bytes_actual=actual,
            kv_bytes_predicted=predicted,
            active_memory=mx.get_active_memory(),
            peak_memory=mx.get_peak_memory(),
            weights_bytes=self.loaded.weights_bytes,
        )


def _shows_drafts(processor) -> bool:
    """Whether a draft step may show ``processor`` its drafts: it is a function of the
    tokens seen (penalties, logit_bias, the end held back), or it keeps state and forgets
    the drafts not kept (a schema's or a tool call's grammar, a thinking budget)."""
    return not getattr(processor, "stateful", False) or hasattr(processor, "rollback")


def _drop_event(event: Event) -> None:
    """A follower rank's requests: rank 0 answers the client."""


def _split(caches: list, row: int) -> list:
    from mlxkv.caches.batched import split_row

    return split_row(caches, row)


def _top_logprobs(row, token, k: int):
    """A position's logprobs as a request asks them, lazy: ``token``'s (an int or a
    scalar array) and the ``k`` best (ids, values) from ``row`` (vocab,)."""
    import mlx.core as mx

    best = mx.argsort(-row)[:k]
    return row[token], best, row[best]


def _resolve(lp) -> tuple[float, tuple[tuple[int, float], ...]] | None:
    """A row's logprobs as numbers (None when the request did not ask)."""
    if lp is None:
        return None
    chosen, best, values = lp
    return chosen.item(), tuple(zip(best.tolist(), values.tolist(), strict=True))


def feed(model, caches: list, tokens, logits: bool = False):
    """One model call over ``tokens`` (1-D) into ``caches``; with ``logits``, the last
    position's logits (1, vocab), evaluated together with the caches."""
    import mlx.core as mx

    from mlxkv.models.head import last_logits

    if logits:
        out = last_logits(model, tokens[None], caches)[:, -1, :]
        mx.eval(out, [c.state for c in caches])
        return out
    model(tokens[None], cache=caches)
    mx.eval([c.state for c in caches])
    return None


def prefill(
    model, caches: list, ids: list[int], start: int, end: int, step: int, evicting=None
) -> None:
    """Feed ``ids[start:end]`` into ``caches`` in the chunks the caches take (a sink cache
    that evicts takes smaller ones: ``evicting`` tokens, when given), each evaluated before
    the next."""
    import mlx.core as mx

    from mlxkv.caches import prefill_chunk

    prompt = mx.array(ids)
    while start < end:
        n = min(prefill_chunk(caches, step, evicting), end - start)
        feed(model, caches, prompt[start : start + n])
        start += n


class SharedPrefixes:
    """A prompt prefix prefilled once; requests whose prompt starts with it copy its caches.

    When a request starts, the prefix it shares with every waiting request that shares at
    least ``min_tokens`` with it is the candidate; a candidate equal to the stored prefix
    (or the stored prefix itself, when the prompt starts with it) is reused as is.
    """

    def __init__(self, make_caches: Callable[[], list], min_tokens: int = 64):
        self.make_caches = make_caches
        self.min_tokens = min_tokens
        self.ids: list[int] = []
        self.caches: list | None = None
        self.hits = 0
        self.prefilled_tokens = 0

    def release(self) -> None:
        """Let the prefix's caches go (its counters stay)."""
        self.ids, self.caches = [], None

    def lookup(self, ids: list[int], others: list[list[int]], prefill) -> tuple[int, list | None]:
        """(tokens the returned caches hold, caches to copy) for prompt ``ids``; (0, None)
        if nothing is shared. ``prefill(caches, ids, start, end)`` fills a new prefix."""
        last = len(ids) - 1  # the prompt's last token gives the first answer token
        held = len(self.ids)
        if self.caches is not None and held <= last and ids[:held] == self.ids:
            self.hits += 1
            return held, self.caches
        shared = [c for o in others if (c := common_prefix(ids, o)) >= self.min_tokens]
        if not shared:
            return 0, None
        n = min(min(shared), last)
        if n < self.min_tokens:
            return 0, None
        caches = self.make_caches()
        prefill(caches, ids, 0, n)
        self.ids, self.caches = ids[:n], caches
        self.prefilled_tokens += n
        self.hits += 1
        return n, caches
