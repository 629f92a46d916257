"""``mlxkv serve``'s prefix cache and memory admission as clients meet them: real server
processes on 127.0.0.1 with the offline default model, the official ``openai`` client.

What the tests read: ``usage.prompt_tokens_details.cached_tokens`` (the tokens a request
did not prefill) and ``/v1/status`` (the counters of prompt tokens prefilled, the prefix
cache's tiers, the memory budget and the reservations)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest

from mlxkv.memory.budget import human_bytes
from mlxkv.memory.system import SystemGauge
from tests.serve_helpers import COUNTING, ROOT, Server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.model
MACHINE = human_bytes(SystemGauge().free().total)  # as a refused --memory-floor names it
SYSTEM = "You are a careful assistant. Answer in one short sentence. " * 6
POLICIES = {  # per-request "kv"; the window evicts within the first turn's prompt
    "full": {},
    "sink+window": {"window": 48, "sinks": 4},
    "4-bit": {"bits": 4},
}


def chat(server: Server, messages: list, kv: dict, max_tokens: int = 8):
    return server.client().chat.completions.create(
        model="smollm2-135m",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"kv": kv},
    )


def cached(resp) -> int:
    return resp.usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve-prefix"))
    yield s
    assert s.stop() == 0, s.log()
    assert "Traceback" not in s.log(), s.log()


@pytest.mark.parametrize(
    "name",
    # 4-bit prefix reuse across turns also runs in CI in tests/test_prefix_cache.py
    [n if n != "4-bit" else pytest.param(n, marks=pytest.mark.slow) for n in POLICIES],
)
def test_a_second_turn_prefills_only_the_new_tokens(server, name):
    kv = POLICIES[name]
    messages = [
        {"role": "system", "content": f"({name}) {SYSTEM}"},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    first = chat(server, messages, kv)
    assert cached(first) == 0
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And of Italy?"},
    ]
    before = server.status()["prompt_tokens_prefilled"]
    second = chat(server, messages, kv)
    # every token of turn 1 (its prompt and its answer) is reused
    assert cached(second) == first.usage.prompt_tokens + first.usage.completion_tokens
    prefilled = server.status()["prompt_tokens_prefilled"] - before
    assert prefilled == second.usage.prompt_tokens - cached(second)
    assert second.usage.model_extra["mlxkv"]["prompt_tokens_cached"] == cached(second)


def test_two_clients_sharing_a_system_prompt_prefill_it_once(server):
    system = "Shared instructions for every client. " * 40  # about 250 tokens
    asks = ["Name a red fruit.", "Name a green vegetable."]
    out: dict[int, object] = {}
    before = server.status()["prompt_tokens_prefilled"]

    def one(i: int) -> None:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": asks[i]}]
        out[i] = chat(server, msgs, {}, max_tokens=4)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    usages = sorted(
        (out[i].usage for i in range(2)), key=lambda u: u.prompt_tokens_details.cached_tokens
    )
    first, second = (u.prompt_tokens_details.cached_tokens for u in usages)
    # the first reuses at most the chat template's opening (other tests' conversations
    # start with it too); the second reuses the whole system prompt the first prefilled
    assert first < 10
    assert second - first >= 240
    prefilled = server.status()["prompt_tokens_prefilled"] - before
    assert prefilled == sum(u.prompt_tokens for u in usages) - first - second


@pytest.mark.slow  # two servers: CI restarts from the folder in-process (test_prefix_cache.py)
def test_a_restarted_server_answers_the_next_turn_from_disk(tmp_path):
    folder = tmp_path / "prefixes"
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Say hello to the restart test."},
    ]
    a = Server(tmp_path / "a", "--prefix-cache-dir", str(folder))
    try:
        first = chat(a, messages, {})
    finally:
        assert a.stop() == 0, a.log()
    files = sorted(folder.glob("prefix-*.safetensors"))
    assert files, a.log()
    b = Server(tmp_path / "b", "--prefix-cache-dir", str(folder))
    try:
        assert b.status()["prefix_cache"]["disk"]["entries"] == len(files)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Thanks."},
        ]
        second = chat(b, messages, {})
        assert cached(second) == first.usage.prompt_tokens + first.usage.completion_tokens
        pc = b.status()["prefix_cache"]
        assert pc["disk"]["hits"] == 1 and pc["hits"] == 1
    finally:
        assert b.stop() == 0, b.log()


def _predicted_reservation(default_model, tokens: int) -> tuple[int, int]:
    """(weights + runtime, one request's KV reservation), as the server computes them."""
    from mlxkv.engine.admission import MemoryBudget
    from mlxkv.policy import KVPolicy

    m = MemoryBudget(default_model, None, 16, 512)
    return m.base(), m.reservation(KVPolicy(), tokens)


def _three_at_once(server: Server, max_tokens: int) -> tuple[list, list[dict]]:
    """Three counting completions sent at once; (their responses, /v1/status polled every
    50 ms while they ran)."""
    results: list = []

    def one_request() -> None:
        r = server.client().completions.create(
            model="smollm2-135m", prompt=COUNTING, max_tokens=max_tokens, temperature=0
        )
        results.append(r)

    threads = [threading.Thread(target=one_request) for _ in range(3)]
    for t in threads:
        t.start()
    polls = []
    deadline = time.monotonic() + 300
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        polls.append(server.status())
        time.sleep(0.05)
    for t in threads:
        t.join(60)
    assert [r.usage.completion_tokens for r in results] == [max_tokens] * 3
    return results, polls


def test_a_budget_for_two_reservations_runs_two_and_queues_the_third(default_model, tmp_path):
    """Three answers at once under a budget that holds two reservations: two run, the third
    waits and then runs; the KV MLX holds never passes the reservations nor they the budget,
    and MLX's peak stays under it (a server without that budget runs all three at once:
    the slow test below). A request that can never fit gets a 400 with the numbers and what
    would fit."""
    max_tokens = 16  # two at once for about 16 steps (a second or two): seen waiting
    base, one = _predicted_reservation(default_model, 20 + max_tokens)
    budget = base + 2 * one + one // 2
    flags = ("--memory", str(budget), "--prefix-cache-bytes", "0", "--max-tokens", "16")
    s = Server(tmp_path / "admitted", *flags)  # the server's default answer fits the budget
    try:
        assert s.status()["memory"]["budget_bytes"] == budget
        _, polls = _three_at_once(s, max_tokens)
        for st in polls:
            m = st["memory"]
            assert len(st["running"]) <= 2, st
            assert m["kv_bytes_actual"] <= m["reserved_bytes"] <= budget - base, st
        assert any(len(st["running"]) == 2 and st["waiting"] == 1 for st in polls)
        assert s.status()["memory"]["peak_bytes"] <= budget

        r = httpx.post(
            f"{s.url}/v1/completions",
            json={"prompt": COUNTING, "max_tokens": 8000, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "kv_budget_exceeded" and err["param"] == "max_tokens"
        assert "GiB of KV cache" in err["message"] and "fits: max_tokens <=" in err["message"]
        assert "\n" not in err["message"]
        assert s.status()["refused"]["too_large"] == 1
    finally:
        assert s.stop() == 0, s.log()


@pytest.mark.slow
def test_without_a_budget_the_three_run_at_once_past_it(default_model, tmp_path):
    """The contrast to the budgeted server above: the same three answers run together and
    hold more KV than that budget left room for."""
    max_tokens = 64
    _, one = _predicted_reservation(default_model, 20 + max_tokens)
    unbounded = Server(tmp_path / "unbounded", "--prefix-cache-bytes", "0")
    try:
        _, polls = _three_at_once(unbounded, max_tokens)
        assert max(len(st["running"]) for st in polls) == 3
        assert max(st["memory"]["kv_bytes_actual"] for st in polls) > 2 * one + one // 2
    finally:
        assert unbounded.stop() == 0, unbounded.log()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--memory", "lots"], "--memory must be a size like 16GB, 16GiB or 512M, got 'lots'"),
        (
            ["--prefix-cache-bytes", "-3"],
            "--prefix-cache-bytes must be a size like 2GB, 512MiB or 0, got '-3'",
        ),
        (
            ["--memory-floor", "a lot"],
            "--memory-floor must be a size like 2GB, 512MiB or 0, got 'a lot'",
        ),
        (
            ["--memory-floor", "100TiB"],
            f"--memory-floor 100TiB leaves this machine nothing: it has {MACHINE} in all; "
            "give a smaller floor, or 0 to keep none",
        ),
        (
            ["--prefix-cache-dir", "README.md"],
            "--prefix-cache-dir README.md is not a folder; name a folder or 'none'",
        ),
        (
            ["--conversation-dir", "README.md"],
            "--conversation-dir README.md is not a folder; name a folder or 'none'",
        ),
        (
            ["--conversation-dir", "README.md/conversations"],
            "--conversation-dir README.md/conversations: Not a directory",
        ),
        (["--batch-requests", "0"], "--batch-requests must be at least 1, got 0"),
        (
            ["--conversation-dir", "none", "--files-dir", "README.md/files"],
            "--files-dir README.md/files: Not a directory",
        ),
    ],
)
def test_bad_memory_flags_are_refused_before_loading(flags, message):
    r = subprocess.run(
        [sys.executable, "-m", "mlxkv", "serve", *flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr == f"mlxkv serve: error: {message}\n"


@pytest.mark.slow
def test_an_answer_with_no_limit_runs_while_the_budget_has_room(default_model, tmp_path):
    """A request that sets no max_tokens (OpenAI's and Ollama's "until the model stops")
    runs past the 512 tokens it first reserves, one reservation step at a time, and ends
    ("length", Ollama's too) where the budget has no room for the next step."""
    ids = len(default_model.tokenizer.encode(COUNTING))
    base, room = _predicted_reservation(default_model, 1280)  # 1,280 tokens of KV
    assert _predicted_reservation(default_model, ids + 1024)[1] <= room
    assert _predicted_reservation(default_model, ids + 1536)[1] > room
    s = Server(tmp_path / "open", "--memory", str(base + room), "--prefix-cache-bytes", "0")
    try:
        body = {"prompt": COUNTING, "temperature": 0}
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=600).json()
        assert r["choices"][0]["finish_reason"] == "length"
        assert r["usage"]["completion_tokens"] == 1024  # two steps of 512
        chat = {"model": "smollm2-135m", "prompt": COUNTING, "raw": True, "stream": False}
        chat["options"] = {"temperature": 0, "num_predict": -1}
        r = httpx.post(f"{s.url}/api/generate", json=chat, timeout=600).json()
        assert (r["done_reason"], r["eval_count"]) == ("length", 1024)
        assert s.status()["memory"]["peak_bytes"] <= base + room
    finally:
        assert s.stop() == 0, s.log()
