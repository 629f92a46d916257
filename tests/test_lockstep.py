"""The ranks' per-step exchange (mlxkv/engine/lockstep.py), in one process: rank 0's scheduler
runs requests, a cancel and a sampled answer while a recorder keeps what it sends each step;
a follower's scheduler then replays those steps. It must reach every step in the state rank
0 was in, and a step whose news went missing must stop it with one error.

The real ranks (``mlx.launch``, the model split over them) are tests/test_serve_distributed.py.
"""

from __future__ import annotations

import json

import pytest

from mlxkv.engine.events import Finished, TokenDelta
from mlxkv.engine.lockstep import RanksApart, StepExchange, check_in_step
from mlxkv.engine.scheduler import Request, Scheduler
from mlxkv.engine.session import GenerationSettings
from mlxkv.policy import KVPolicy

pytestmark = pytest.mark.model


class Recorder:
    """Rank 0's side: what it would send each step, kept (as JSON, as it travels)."""

    leader = True

    def __init__(self):
        self.steps: list[tuple[str, int]] = []

    def exchange(self, news: dict | None, digest: int) -> dict:
        self.steps.append((json.dumps(news or {}), digest))
        return news or {}

    def largest(self, nbytes: int) -> int:
        return nbytes  # one process: the only share is the whole model


class Replayer:
    """A follower's side: each step, rank 0's recorded news and digest."""

    leader = False

    def __init__(self, steps: list[tuple[str, int]]):
        self.steps = list(steps)

    def exchange(self, news: dict | None, digest: int) -> dict:
        if not self.steps:
            return {"stop": True}
        sent, leader_digest = self.steps.pop(0)
        check_in_step([leader_digest, digest])
        return json.loads(sent)

    def largest(self, nbytes: int) -> int:
        return nbytes  # one process: the only share is the whole model


def _ids(loaded, text: str) -> list[int]:
    chat = [{"role": "user", "content": text}]
    prompt = loaded.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return Scheduler(loaded).encode(prompt)


def _lead(loaded) -> tuple[Scheduler, Recorder, list]:
    """Rank 0: a greedy answer cancelled after 3 tokens (with a time limit, which no rank
    applies: each has its own clock) beside a sampled one (no seed) under its own policy,
    both submitted before the first step."""
    recorder: StepExchange = Recorder()
    sched = Scheduler(loaded, max_batch=4, lockstep=recorder)
    timed = GenerationSettings(max_tokens=16, time_limit=0.0)
    greedy = sched.submit(Request(_ids(loaded, "Count to ten."), timed))
    sampled = sched.submit(
        Request(
            _ids(loaded, "Name a colour."),
            # all 10 tokens: an answer that ended before the cancel would leave the cancel
            # in the last step, after which a follower that missed it checks no digest
            GenerationSettings(max_tokens=10, temperature=0.8, min_tokens=10),
            policy=KVPolicy(window=24, sinks=4),
        )
    )
    tokens = 0
    for ev in greedy.events():
        if isinstance(ev, TokenDelta):
            tokens += 1
            if tokens == 3:
                greedy.cancel()
        last = ev
    answers = [last, list(sampled.events())[-1]]
    sched.close()
    return sched, recorder, answers


@pytest.fixture(scope="module")
def led(default_model):
    return _lead(default_model)


def test_a_follower_replays_rank_0s_steps_in_step(default_model, led):
    leader, recorder, (greedy, sampled) = led
    assert isinstance(greedy, Finished) and greedy.finish_reason == "cancelled"
    assert isinstance(sampled, Finished)
    n = sampled.stats.generation_tokens
    assert n == 10
    sent = [json.loads(news) for news, _ in recorder.steps]
    arrived = [r for news in sent for r in news.get("arrived", ())]
    assert [len(r["ids"]) > 0 for r in arrived] == [True, True]
    # The sampled request travels with the seed rank 0 drew for it, and rank 0 uses it too.
    seed = arrived[1]["settings"]["seed"]
    assert isinstance(seed, int) and arrived[0]["settings"]["seed"] is None
    assert arrived[0]["settings"]["time_limit"] is None
    assert arrived[1]["policy"]["window"] == 24
    assert [news["cancelled"] for news in sent if news.get("cancelled")] == [[arrived[0]["id"]]]

    follower = Scheduler(default_model, max_batch=4, lockstep=Replayer(recorder.steps))
    follower.follow()  # every step's digest matched rank 0's
    assert follower.leader_stopped and follower.idle
    assert follower.steps == leader.steps
    assert follower.tokens_generated == leader.tokens_generated == 3 + n


@pytest.mark.parametrize("missing", ["cancelled", "seed"])
def test_a_step_that_missed_news_stops_the_follower(default_model, led, missing):
    """Without the cancel, the follower decodes the greedy answer on; without rank 0's seed,
    it samples other tokens. At the next step its state is not rank 0's, and it stops with
    one error instead of waiting in collectives that never meet."""
    _, recorder, _ = led
    steps = []
    for news, digest in recorder.steps:
        d = json.loads(news)
        if missing == "cancelled":
            d.pop("cancelled", None)
        else:
            for r in d.get("arrived", ()):
                r["settings"]["seed"] = None
        steps.append((json.dumps(d), digest))
    follower = Scheduler(default_model, max_batch=4, lockstep=Replayer(steps))
    with pytest.raises(RanksApart) as e:
        follower.follow()
    assert str(e.value) == (
        "rank 1's scheduler no longer holds what rank 0's does (a step failed on some ranks "
        "only); the server stops rather than wait on it"
    )
