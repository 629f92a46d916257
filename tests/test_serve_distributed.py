"""``mlxkv serve`` under a real ``mlx.launch``: the tiny qwen2 split over 2 ranks on
127.0.0.1, asked through the official openai client, against one process serving it whole.

Every rank runs the same scheduler, rank 0's requests and cancels reaching the others at the
start of each step (mlxkv/engine/lockstep.py); a rank that fell out of step would leave
the others waiting in a collective, so these tests also check that the server goes on
answering after batches, cancels and kept prefixes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from mlxkv.bench.serve import free_ports
from tests.serve_helpers import Server, group_members
from tests.test_distributed import BIN, ONE_THREAD

# The prefix cache keeps no files under mlx.launch: both servers keep prefixes in memory.
FLAGS = ("--prefix-cache-dir", "none", "--max-tokens", "12")


def launcher(n: int) -> list[str]:
    return [str(BIN / "mlx.launch"), "-n", str(n), "--starting-port", str(free_ports(n)), "--"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_qwen2):
    tmp = tmp_path_factory.mktemp("split_serve")
    split = Server(tmp / "split", "--model", str(tiny_qwen2), *FLAGS, env=ONE_THREAD,
                   launcher=launcher(2))  # fmt: skip
    try:
        whole = Server(tmp / "whole", "--model", str(tiny_qwen2), *FLAGS, env=ONE_THREAD)
    except BaseException:
        split.stop()
        raise
    yield split, whole
    whole.stop()
    split.stop()


def model_id(server: Server) -> str:
    return server.http("GET", "/v1/models").json()["data"][0]["id"]


def ask(server: Server, text: str, seed: int, history: list | None = None):
    messages = [*(history or []), {"role": "user", "content": text}]
    r = server.client().chat.completions.create(
        model=model_id(server), messages=messages, temperature=1.0, seed=seed, max_tokens=12
    )
    return r.choices[0].message.content, r.usage


def test_the_split_server_answers_as_one_process(servers):
    """Sampling at temperature 1 turns any wrong sum into other tokens. The same requests,
    in the same order, give the same text on 2 ranks as on one; the second turn of a
    conversation reuses the first turn's kept caches on both."""
    split, whole = servers
    assert "split over 2 ranks" in split.log()
    assert (split.status()["ranks"], whole.status()["ranks"]) == (2, 1)
    for seed, text in [(1, "hello number 1"), (3, "hello number 3"), (4, "hello number 4")]:
        a, ua = ask(split, text, seed)
        b, ub = ask(whole, text, seed)
        assert a == b and ua.completion_tokens == ub.completion_tokens == 12
    history = [
        {"role": "user", "content": "hello number 4"},
        {"role": "assistant", "content": ask(whole, "hello number 4", 4)[0]},
    ]
    a, ua = ask(split, "and then?", 7, history)
    b, ub = ask(whole, "and then?", 7, history)
    assert a == b
    assert ua.prompt_tokens_details.cached_tokens == ub.prompt_tokens_details.cached_tokens > 0


def test_batches_and_cancels_keep_the_ranks_in_step(servers):
    """Three streamed answers at once share a batch; one client hangs up after its first
    piece. The other two run to their 24 tokens, and the server answers afterwards as one
    process does. (The clients are made before the barrier and the answers are long enough
    that a loaded machine still starts the three within one answer's time.)"""
    split, whole = servers
    before = split.status()["max_rows_in_a_step"]
    got: dict[int, list[str]] = {}
    started = threading.Barrier(3)
    name = model_id(split)

    def stream(seed: int) -> None:
        client = split.client()
        started.wait()
        s = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": f"stream {seed}"}],
            temperature=1.0,
            seed=seed,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
        got[seed] = []
        for chunk in s:
            if chunk.usage is not None:
                got[seed].append(f"usage {chunk.usage.completion_tokens}")
            elif chunk.choices and chunk.choices[0].delta.content:
                got[seed].append(chunk.choices[0].delta.content)
                if seed == 0:
                    s.close()  # hang up mid-answer
                    return

    threads = [threading.Thread(target=stream, args=(seed,)) for seed in (0, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert len(got[0]) == 1
    assert got[1][-1] == got[2][-1] == "usage 24"
    status = split.wait_idle()
    assert status["max_rows_in_a_step"] >= 2 or before >= 2
    a, _ = ask(split, "hello number 3", 3)
    assert a == ask(whole, "hello number 3", 3)[0]


def gone(group: int, timeout: float = 60) -> bool:
    """Whether every process of ``group`` ends within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while group_members(group) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not group_members(group)


def test_ctrl_c_stops_every_rank(servers):
    """The last test of the module to use the servers: it stops the split one. Ctrl+C
    reaches the launcher and every rank; rank 0 stops serving and tells the others to stop.
    No rank is left holding its share or the port."""
    split, _ = servers
    port = int(split.url.rsplit(":", 1)[1])
    group = split.proc.pid  # the launcher leads the group its ranks are in
    assert len(group_members(group)) == 3
    os.killpg(group, signal.SIGINT)  # what a terminal's Ctrl+C sends
    split.proc.wait(120)
    assert gone(group)
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port)):
        pass


@pytest.mark.slow  # (the fast suite stops ranks through Ctrl+C and a failing rank)
def test_a_killed_launcher_stops_its_ranks(tmp_path, tiny_qwen2):
    """A launcher killed on its own stops nothing, but its ranks see their stdin (its pipe)
    end and stop: no rank is left holding its share or the port."""
    server = Server(tmp_path, "--model", str(tiny_qwen2), *FLAGS, env=ONE_THREAD,
                    launcher=launcher(2))  # fmt: skip
    try:
        assert ask(server, "hello", 1)[1].completion_tokens == 12
        port = int(server.url.rsplit(":", 1)[1])
        group = server.proc.pid
        assert len(group_members(group)) == 3
        server.proc.kill()
        server.proc.wait(120)
        assert gone(group)
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port)):
            pass
    finally:
        server.stop()


def launch_serve(*args: str) -> subprocess.CompletedProcess:
    cmd = [*launcher(2), sys.executable, "-m", "mlxkv", "serve", "--port", "0", *args]
    env = {**os.environ, **ONE_THREAD}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow  # (CI refuses that split for generate: test_distributed.py)
def test_a_model_serve_cannot_split_is_refused_in_one_line(default_model_path):
    """SmolLM2's 9 heads do not split 2 ways and mlx-lm cannot split llama by layers.
    mlx.launch exits 0 whatever its ranks do, so the message is what tells the user."""
    run = launch_serve("--model", str(default_model_path))
    assert (
        "mlxkv serve: error: tensor parallelism over 2 hosts needs attention heads divisible "
        "by 2; the model has 9: use a host count that divides 9 (mlx-lm has no pipeline split "
        "for llama)\n"
    ) in run.stderr
    assert "Traceback" not in run.stderr


def test_a_prefix_cache_folder_under_mlx_launch_is_refused_in_one_line(tiny_qwen2):
    """A prefix-cache folder would differ on every host. mlx.launch exits 0 whatever its
    ranks do, so the message is what tells the user."""
    run = launch_serve("--model", str(tiny_qwen2), "--prefix-cache-dir", "pc")
    assert (
        "mlxkv serve: error: --prefix-cache-dir works in one process: under mlx.launch each "
        "host would keep other files; drop it\n"
    ) in run.stderr
    assert "Traceback" not in run.stderr


def ask_kv(server: Server, messages: list, seed: int, kv: dict | None) -> tuple[str, int]:
    """(text, prompt tokens from the prefix cache) of a sampled answer under ``kv``."""
    body = {"messages": messages, "temperature": 1.0, "seed": seed, "max_tokens": 12}
    r = server.http("POST", "/v1/chat/completions", json=body | ({"kv": kv} if kv else {}))
    assert r.status_code == 200, r.text
    j = r.json()
    return j["choices"][0]["message"]["content"], j["usage"]["prompt_tokens_details"][
        "cached_tokens"
    ]


# Room for one finished answer's caches as rank 0 holds them (3 layers x 2 KV heads x 32
# dims x K and V x 4 bytes x a 256-token buffer = 393,216 bytes), not two: kept prefixes are
# evicted as the conversations go on.
ONE_ENTRY = "600000"


@pytest.mark.slow  # (the fast suite splits by layers in test_distributed, serves a split by heads)
def test_a_model_split_by_layers_answers_as_one_process(tmp_path, servers, tiny_qwen2):
    """--shard pipeline: the tiny qwen2's 5 layers split 3 + 2, so the ranks hold unequal
    shares (rank 1's kept caches are 2/3 of rank 0's); every rank admits and evicts by the
    largest share's figures. The same seeded texts as one process, rank 0's KV is its 3
    layers' share, and a conversation's next turn (full, and a sink + window cache that goes
    back to its turn-boundary copy) starts from its kept prefix while evictions go on."""
    _, whole = servers
    split = Server(tmp_path, "--model", str(tiny_qwen2), *FLAGS, "--shard", "pipeline",
                   "--prefix-cache-bytes", ONE_ENTRY, env=ONE_THREAD,
                   launcher=launcher(2))  # fmt: skip
    try:
        assert "prefix cache 0.00 GiB in memory" in split.log()
        for seed in (1, 3):
            a, ua = ask(split, f"hello number {seed}", seed)
            b, ub = ask(whole, f"hello number {seed}", seed)
            assert a == b
            assert ua.model_extra["mlxkv"]["kv_bytes_actual"] * 5 == (
                ub.model_extra["mlxkv"]["kv_bytes_actual"] * 3
            )
        for kv in (None, {"window": 8, "sinks": 4}):
            turns, cached = [{"role": "user", "content": "tell me of the sea"}], []
            for seed in (5, 6, 7):
                a, held = ask_kv(split, turns, seed, kv)
                assert a == ask_kv(whole, turns, seed, kv)[0]
                cached.append(held)
                turns += [{"role": "assistant", "content": a}, {"role": "user", "content": "go on"}]
            # the first turn shares at most the system prompt with earlier requests
            assert cached[0] < cached[1] < cached[2], (kv, cached)
        status = split.status()
        assert status["ranks"] == 2
        assert status["prefix_cache"]["entries"] >= 1
        assert status["prefix_cache"]["bytes"] <= 600000
        assert "Traceback" not in split.log()
    finally:
        split.stop()


@pytest.mark.slow  # 20 s: CI ends the rows of an engine that never answers in test_bridge.py
@pytest.mark.parametrize(
    "fault",
    # SIGSTOP: rank 1 never joins the next collective, and rank 0's engine waits in it for
    # good. SIGKILL: the ring backend may fail that collective (the engine's own error) or
    # wait as for SIGSTOP.
    ["stopped", "killed"],
)
def test_a_rank_that_fails_ends_the_streams_with_an_error(tmp_path, tiny_qwen2, fault):
    """Rank 1 fails while an answer streams. mlx.launch stops rank 0 (SIGTERM, sent here
    for a stopped rank, which mlx.launch cannot see). An engine that never answers the cut
    has its answers ended by the server, each with the shutting_down error event, not a
    stream that just stops; every process exits."""
    server = Server(tmp_path, "--model", str(tiny_qwen2), *FLAGS, "--shutdown-timeout", "1",
                    env=ONE_THREAD, launcher=launcher(2))  # fmt: skip
    try:
        group = server.proc.pid
        ranks = {_environ(p).split(b"MLX_RANK=")[1][:1]: p for p in group_members(group)
                 if b"MLX_RANK=" in _environ(p)}  # fmt: skip
        body = {
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4000,
            "temperature": 1.0,
            "stream": True,
        }
        lines = []
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 3 and fault == "killed":
                        os.kill(ranks[b"1"], signal.SIGKILL)
                    elif len(lines) == 3:
                        os.kill(ranks[b"1"], signal.SIGSTOP)
                        os.kill(ranks[b"0"], signal.SIGTERM)
        assert len(lines) > 3
        error = json.loads(lines[-1][len("data: ") :])["error"]
        if fault == "stopped" or error["code"] == "shutting_down":
            assert error == {
                "message": "the server stopped before this answer ended (its engine did not "
                "answer the cut)",
                "type": "server_error",
                "param": None,
                "code": "shutting_down",
            }
        else:
            assert error["code"] == "internal"
            assert error["message"].startswith("the engine failed: ")
        if fault == "stopped":
            assert _exits(ranks[b"0"], group)
            os.kill(ranks[b"1"], signal.SIGKILL)
        assert gone(group)
    finally:
        server.stop()


def _exits(pid: int, group: int, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while pid in group_members(group) and time.monotonic() < deadline:
        time.sleep(0.2)
    return pid not in group_members(group)


def _environ(pid: int) -> bytes:
    try:
        return open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        return b""
