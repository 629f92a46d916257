"""Watching a running ``mlxkv serve``: ``GET /metrics`` scraped and parsed as Prometheus
reads it, next to ``GET /v1/status`` and the ``usage`` of real requests (the official
``openai`` client), and ``mlxkv top`` in a real terminal (tmux). One server, with a key."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlxkv.engine.pressure import default_floor
from mlxkv.memory.system import SystemGauge
from tests.serve_helpers import COUNTING, ROOT, Server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.model
KEY = "sk-observe-5678"
QUESTION = "What is the capital of France?"
WINDOW = {"window": 16, "sinks": 4}  # "sink 4 + window 16": its KV bytes stop growing
FLOOR = default_floor(SystemGauge().free().total)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-observe")
    s = Server(
        tmp,
        "--prefix-cache-dir",
        str(tmp / "prefix-cache"),
        # one answer at a time and none waiting: a second request while one runs gets a 429
        "--max-batch",
        "1",
        "--max-queue",
        "0",
        # weights 0.50 GiB + runtime 0.55 GiB leave 0.16 GiB of KV: 8,000 tokens never fit
        "--memory",
        "1300MB",
        env={"MLXKV_API_KEY": KEY},
        key=KEY,
    )
    yield s
    code = s.stop()
    assert code == 0, s.log()
    assert "Traceback" not in s.log(), s.log()


def scrape(server: Server) -> dict[str, float]:
    """``GET /metrics`` as Prometheus parses it: sample name (with its labels) -> value."""
    r = server.http("GET", "/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


@contextlib.contextmanager
def long_stream(server: Server, max_tokens: int = 400):
    """A streamed completion under WINDOW that is running (it has sent text) until the
    block ends; leaving the block closes the stream, which cancels the request."""
    stream = server.client().completions.create(
        model="smollm2-135m",
        prompt=COUNTING,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"kv": WINDOW},
    )
    try:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                break
        yield stream
    finally:
        stream.close()


def same_as_status(metrics: dict[str, float], status: dict) -> None:
    """Every figure /metrics exports from the status equals the status' own."""
    mem, cache = status["memory"], status["prefix_cache"]
    for key in ("kv_bytes_actual", "kv_bytes_predicted", "reserved_bytes", "weights_bytes"):
        assert metrics[f"mlxkv_{key}"] == mem[key], key
    assert metrics["mlxkv_runtime_bytes"] == mem["runtime_bytes"]
    assert metrics["mlxkv_memory_budget_bytes"] == mem["budget_bytes"] > 0
    assert metrics["mlxkv_prefix_cache_bytes{tier=memory}"] == mem["prefix_cache_bytes"]
    assert metrics["mlxkv_requests_waiting"] == status["waiting"]
    for key in ("entries", "bytes", "limit_bytes"):
        assert metrics[f"mlxkv_prefix_cache_{key}{{tier=memory}}"] == cache[key], key
        assert metrics[f"mlxkv_prefix_cache_{key}{{tier=disk}}"] == cache["disk"][key], key
    assert metrics["mlxkv_prefix_cache_misses_total"] == cache["misses"]
    assert metrics["mlxkv_prefix_cache_tokens_reused_total"] == cache["tokens_reused"]
    for key in ("requests_finished", "prompt_tokens_prefilled", "prompt_tokens_cached"):
        assert metrics[f"mlxkv_{key}_total"] == status[key], key
    assert metrics["mlxkv_tokens_generated_total"] == status["tokens_generated"]
    for key in ("draft_tokens", "draft_tokens_accepted"):
        assert metrics[f"mlxkv_{key}_total"] == status[key], key
    assert metrics["mlxkv_scheduler_steps_total"] == status["steps"]
    machine = status["machine_memory"]  # the default --memory-floor: a tenth of the machine
    assert metrics["mlxkv_machine_floor_bytes"] == machine["floor_bytes"] == FLOOR
    assert metrics["mlxkv_machine_under_floor"] == machine["under_floor"] == 0
    assert metrics["mlxkv_machine_given_back_bytes_total"] == machine["given_back_bytes"] == 0
    # read a second apart at most, while the other tests' processes come and go (one of
    # them takes 3 GiB for a moment)
    now = SystemGauge().free()
    assert 0 < machine["free_bytes"] <= now.total
    assert abs(metrics["mlxkv_machine_free_bytes"] - machine["free_bytes"]) < 4 * 2**30
    assert abs(machine["free_bytes"] - now.available) < 4 * 2**30


def test_counters_move_by_the_requests(server):
    server.wait_idle()
    before = scrape(server)
    client = server.client()
    turn = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(
        model="smollm2-135m", messages=turn, max_tokens=8, temperature=0
    )
    turn += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And of Spain?"},
    ]
    second = client.chat.completions.create(
        model="smollm2-135m", messages=turn, max_tokens=8, temperature=0
    )
    text = client.completions.create(
        model="smollm2-135m", prompt=COUNTING, max_tokens=6, temperature=0
    )
    status = server.wait_idle()
    after = scrape(server)
    same_as_status(after, status)

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0)

    usages = [r.usage for r in (first, second, text)]
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    # the second turn finds the whole first turn (prompt and answer) in the prefix cache
    assert cached[1] == first.usage.total_tokens
    assert moved("mlxkv_requests_finished_total") == 3
    assert moved("mlxkv_tokens_generated_total") == sum(u.completion_tokens for u in usages) == 22
    assert moved("mlxkv_prompt_tokens_cached_total") == sum(cached)
    assert moved("mlxkv_prompt_tokens_prefilled_total") == sum(
        u.prompt_tokens - c for u, c in zip(usages, cached, strict=True)
    )
    hits = sum(1 for c in cached if c)
    assert moved("mlxkv_prefix_cache_hits_total{tier=memory}") == hits
    assert moved("mlxkv_prefix_cache_misses_total") == 3 - hits
    assert moved("mlxkv_prefix_cache_tokens_reused_total") == sum(cached)
    cache = status["prefix_cache"]
    assert after["mlxkv_prefix_cache_hit_ratio{tier=memory}"] == pytest.approx(
        (cache["hits"] - cache["disk"]["hits"]) / (cache["hits"] + cache["misses"])
    )
    assert after["mlxkv_requests_running"] == 0 and after["mlxkv_requests_waiting"] == 0
    assert after["mlxkv_kv_bytes_actual"] == 0 and after["mlxkv_reserved_bytes"] == 0
    assert after["mlxkv_prefix_cache_bytes{tier=memory}"] > 0  # the finished turns are kept


STEADY = ("memory", "tokens_generated", "steps", "requests_finished", "prompt_tokens_prefilled")


def test_kv_gauges_equal_the_status_while_a_request_runs(server):
    server.wait_idle()
    with long_stream(server):
        # two statuses that agree around a scrape: the scrape saw the same figures (under a
        # window the memory stays the same while tokens go on: the counters must agree too)
        for _ in range(200):
            first = server.status()
            metrics = scrape(server)
            second = server.status()
            if first["running"] and all(first[k] == second[k] for k in STEADY):
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the status kept changing: {first} {second}")
    same_as_status(metrics, first)
    (row,) = first["running"]
    mem = first["memory"]
    assert row["policy"] == "sink 4 + window 16"
    assert metrics["mlxkv_requests_running"] == 1
    assert row["kv_bytes"] == mem["kv_bytes_actual"] == row["kv_bytes_predicted"] > 0
    # the request's reservation is all that is reserved, and covers what it holds
    assert row["reserved_bytes"] == mem["reserved_bytes"] >= row["kv_bytes"]
    server.wait_idle()


def test_refused_requests_are_counted(server):
    server.wait_idle()
    before = scrape(server)
    client = server.client()
    with long_stream(server):
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=4)
    server.wait_idle()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2-135m", prompt="Hello", max_tokens=8000)
    assert e.value.body["code"] == "kv_budget_exceeded"
    after = scrape(server)
    status = server.status()
    for reason in ("busy", "too_large"):
        name = f"mlxkv_requests_refused_total{{reason={reason}}}"
        assert after[name] - before[name] == 1, reason
        assert after[name] == status["refused"][reason]
    assert after["mlxkv_memory_budget_bytes"] == 1_300_000_000


def test_a_background_stream_that_can_never_fit_ends_failed(server):
    """A streamed background response the budget can never hold: its stream (read again
    from the start, as a client resuming would) ends with response.failed carrying the
    budget's error, which the stored response holds too."""
    server.wait_idle()
    client = server.client()
    ask = {"model": "smollm2-135m", "input": "Hello", "max_output_tokens": 8000}
    first = list(client.responses.create(**ask, background=True, stream=True))
    rid = first[0].response.id
    again = list(client.responses.retrieve(rid, stream=True))
    assert [e.type for e in again] == [
        "response.created",
        "response.queued",
        "response.failed",
    ]
    assert [e.model_dump() for e in first] == [e.model_dump() for e in again]
    failed = again[-1].response
    stored = client.responses.retrieve(rid)
    assert failed.status == stored.status == "failed"
    assert failed.error.code == stored.error.code == "kv_budget_exceeded"
    assert failed.error.message == stored.error.message


def test_metrics_need_the_key_and_health_does_not(server):
    r = httpx.get(f"{server.url}/metrics", timeout=60)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert "mlxkv_" not in r.text
    wrong = httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer no"}, timeout=60)
    assert wrong.status_code == 401
    assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200


def top(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlxkv", "top", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


def test_top_without_a_server_says_so_in_one_line():
    done = top("http://127.0.0.1:1")
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr == (
        "mlxkv top: error: cannot connect to http://127.0.0.1:1 (is mlxkv serve running there?)\n"
    )


def test_top_never_echoes_a_password_in_the_url():
    done = top("http://me:s3cret@127.0.0.1:1/v1")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "mlxkv top: error: the URL holds a user or password; give http://127.0.0.1:1 and the "
        "key with --api-key or MLXKV_API_KEY\n"
    )


def test_top_of_a_server_that_is_not_mlxkv_says_so_in_one_line(tmp_path):
    other = subprocess.Popen(
        [sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1", "-d", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        port = re.search(r"port (\d+)", other.stdout.readline()).group(1)
        done = top(f"http://127.0.0.1:{port}")
    finally:
        other.terminate()
        other.wait(30)
    assert done.returncode == 1
    assert done.stderr == (
        f"mlxkv top: error: http://127.0.0.1:{port} is not an mlxkv server: "
        "GET /v1/status answered HTTP 404\n"
    )


def test_top_without_the_key_says_so_in_one_line(server):
    env = {k: v for k, v in os.environ.items() if k != "MLXKV_API_KEY"}
    done = top(server.url, env=env)
    assert done.returncode == 1
    assert done.stderr == (
        f"mlxkv top: error: {server.url} wants an API key: give it with --api-key or "
        "MLXKV_API_KEY\n"
    )


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_top_in_a_terminal_shows_the_running_request(server, tmp_path):
    session = f"mlxkv-top-{uuid.uuid4().hex[:8]}"
    done = tmp_path / "exit"
    cmd = shlex.join(
        [sys.executable, "-m", "mlxkv", "top", f"{server.url}/v1", "--interval", "0.3"]
    )
    script = f"cd {shlex.quote(str(ROOT))} && {cmd} --api-key {KEY}; echo $? > {done}"
    tmux("new-session", "-d", "-s", session, "-x", "120", "-y", "40")
    try:
        with long_stream(server):
            tmux("send-keys", "-t", session, script, "Enter")
            end = time.monotonic() + 120
            while True:
                pane = tmux("capture-pane", "-p", "-t", session)
                if "sink 4 + window 16" in pane and "Running 1" in pane:
                    break
                assert time.monotonic() < end, pane
                time.sleep(0.3)
        assert f"smollm2-135m at {server.url} · policy full" in pane
        assert "█" in pane  # the memory bar
        assert re.search(r"free \S+ \S+ of budget \S+ \S+", pane)
        assert re.search(r"weights \S+ \S+ +runtime \S+ \S+ +reserved \S+ \S+ \(KV \S+ \S+\)", pane)
        assert "KV actual" in pane and "Prefix cache" in pane
        assert "connected · every 0.3 s · q quits" in pane
        tmux("send-keys", "-t", session, "q")
        end = time.monotonic() + 30
        while not done.exists():
            assert time.monotonic() < end, tmux("capture-pane", "-p", "-t", session)
            time.sleep(0.2)
        assert done.read_text().strip() == "0"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    server.wait_idle()


def test_a_predicted_output_gives_the_drafts_and_leaves_the_answer(server, default_model):
    """OpenAI's ``prediction``: an answer that copies nothing from its prompt takes its
    drafts (the server's default --draft-tokens 8) from the text the client expects back.
    The answer is mlx-lm's greedy answer whatever the prediction says; usage counts the
    drafts taken and refused, and /metrics counts them as the status does."""
    from tests.mlx_lm_ref import greedy_tokens

    messages = [{"role": "user", "content": "Why is the sky blue? Explain in a few sentences."}]
    tok = default_model.tokenizer
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    ref = tok.decode(greedy_tokens(default_model, ids, 24, []))
    client = server.client()

    def ask(text=None, temperature=0, **more):
        extra = {} if text is None else {"prediction": {"type": "content", "content": text}}
        return client.chat.completions.create(
            model="smollm2-135m",
            messages=messages,
            max_tokens=24,
            temperature=temperature,
            **extra,
            **more,
        )

    server.wait_idle()
    before = scrape(server)
    plain, good = ask(), ask([{"type": "text", "text": ref}])
    status = server.wait_idle()
    after = scrape(server)
    same_as_status(after, status)
    assert plain.choices[0].message.content == good.choices[0].message.content == ref
    assert good.usage.prompt_tokens == len(ids)
    details = good.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= 20  # most of the 24 came as drafts
    taken = 0
    if plain.usage.completion_tokens_details:  # drafts from the prompt alone: few if any
        taken = plain.usage.completion_tokens_details.accepted_prediction_tokens
    assert taken < 8
    moved = after["mlxkv_draft_tokens_accepted_total"] - before["mlxkv_draft_tokens_accepted_total"]
    assert moved == taken + details.accepted_prediction_tokens
    checked = after["mlxkv_draft_tokens_total"] - before["mlxkv_draft_tokens_total"]
    assert checked == moved + details.rejected_prediction_tokens + (
        plain.usage.completion_tokens_details.rejected_prediction_tokens
        if plain.usage.completion_tokens_details
        else 0
    )
    # a sampled answer checks its drafts on its sampler's distribution: with top_k 1 that
    # is the argmax's, so it is the greedy answer, taken from the prediction
    sampled = ask(ref, temperature=1.0, extra_body={"top_k": 1})
    assert sampled.choices[0].message.content == ref
    assert sampled.usage.completion_tokens_details.accepted_prediction_tokens >= 20
