"""A long mixed workload against one ``mlxkv serve``: does its memory come back?

Clients send, in turn, every kind of request the server takes (chat under four KV policies,
streams the client drops after a few chunks, growing multi-turn conversations that hit the
prefix cache, text completions with logprobs and ``n`` 2, stored Responses chained by
``previous_response_id``, Anthropic messages, Ollama streams, schema-held answers, and
requests the server refuses), ``concurrency`` at a time, until ``requests`` are done or
``max_seconds`` pass. Every ``every`` seconds, and once more when the server is idle at
the end, it records the process's resident memory (Linux ``VmRSS``) and the server's own
memory figures (``GET /v1/status``: MLX active bytes, the prefix cache, reservations, the
response store).

What a leak would look like: resident memory that keeps climbing after the warm-up once the
prefix cache and the response store have reached their bounds, or MLX active bytes at idle
above weights + kept prefixes.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx

from mlxkv.bench.serve import ServerProcess, free_port

POLICIES = [None, {"window": 64, "sinks": 4}, {"bits": 4}, {"window": 128, "bits": 8}]
KINDS = (
    "chat", "stream_dropped", "conversation", "completion", "responses", "messages",
    "ollama", "schema", "conversation", "refused",
)  # fmt: skip
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
    "required": ["city", "year"],
}


def passages(corpus: Path, count: int, words: int) -> list[str]:
    text = corpus.read_text(encoding="utf-8", errors="replace").split()
    return [" ".join(text[5000 + i * words : 5000 + (i + 1) * words]) for i in range(count)]


class Workload:
    """The ``i``-th request of the run, sent and read to its end (or dropped)."""

    def __init__(self, url: str, model: str, corpus: Path, conversations: int = 4):
        self.model = model
        self.texts = passages(corpus, 400, 110)
        self.convs = [[] for _ in range(conversations)]
        self.locks = [threading.Lock() for _ in range(conversations)]
        self.last_response: str | None = None
        self.http = httpx.Client(base_url=url, timeout=600)

    def send(self, i: int) -> str:
        kind = KINDS[i % len(KINDS)]
        getattr(self, kind)(i)
        return kind

    def _post(self, path: str, body: dict, ok=(200,)) -> dict:
        r = self.http.post(path, json=body)
        if r.status_code not in ok:
            raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:200]}")
        return r.json()

    def chat(self, i: int) -> None:
        body = {"model": self.model, "max_tokens": 24, "temperature": 0.7, "seed": i}
        body["messages"] = [{"role": "user", "content": "Say something about " + self.text(i)}]
        if (policy := POLICIES[i // len(KINDS) % len(POLICIES)]) is not None:
            body["kv"] = policy
        self._post("/v1/chat/completions", body)

    def stream_dropped(self, i: int) -> None:
        body = {"model": self.model, "max_tokens": 300, "stream": True}
        body["messages"] = [{"role": "user", "content": "Tell a long story about " + self.text(i)}]
        with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= 6:
                    break  # the client leaves; the server must free the row

    def conversation(self, i: int) -> None:
        c = i // len(KINDS) % len(self.convs)
        with self.locks[c]:
            chat = self.convs[c]
            if sum(len(m["content"]) for m in chat) > 12000:  # about 3000 tokens: start over
                chat.clear()
            chat.append({"role": "user", "content": self.text(i) + "\nWhat happens here?"})
            body = {"model": self.model, "messages": chat, "max_tokens": 16, "temperature": 0}
            if c % 2:
                body["kv"] = {"window": 512, "sinks": 4}
            out = self._post("/v1/chat/completions", body)
            chat.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})

    def completion(self, i: int) -> None:
        body = {"model": self.model, "prompt": self.text(i), "max_tokens": 12}
        self._post("/v1/completions", body | {"n": 2, "logprobs": 2, "seed": i})

    def responses(self, i: int) -> None:
        body = {"model": self.model, "input": self.text(i) + "\nSum it up."}
        body["max_output_tokens"] = 16
        previous = self.last_response
        if previous and i % 3:
            body["previous_response_id"] = previous
        try:
            out = self._post("/v1/responses", body)
        except RuntimeError:  # the chained response left the bounded store: start a chain
            body.pop("previous_response_id", None)
            out = self._post("/v1/responses", body)
        self.last_response = out["id"]

    def messages(self, i: int) -> None:
        body = {"model": self.model, "max_tokens": 16, "system": "Be brief."}
        body["messages"] = [{"role": "user", "content": self.text(i)}]
        self._post("/v1/messages", body)

    def ollama(self, i: int) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": self.text(i)}]}
        body["options"] = {"num_predict": 16, "num_ctx": 2048}
        with self.http.stream("POST", "/api/chat", json=body) as r:
            for _ in r.iter_lines():
                pass

    def schema(self, i: int) -> None:
        body = {"model": self.model, "max_tokens": 40, "temperature": 0}
        body["messages"] = [{"role": "user", "content": "Where and when? " + self.text(i)}]
        held = {"name": "w", "schema": SCHEMA}
        body["response_format"] = {"type": "json_schema", "json_schema": held}
        self._post("/v1/chat/completions", body)

    def refused(self, i: int) -> None:
        body = {"model": self.model, "messages": [], "max_tokens": 16}
        self._post("/v1/chat/completions", body, ok=(400,))

    def text(self, i: int) -> str:
        return self.texts[i % len(self.texts)]


def sample(server: ServerProcess, done: int, started: float) -> dict:
    status = httpx.get(f"{server.url}/v1/status", timeout=60).json()
    memory = status["memory"]
    return {
        "t_s": round(time.monotonic() - started, 1),
        "requests": done,
        "rss_mib": round((server.rss() or 0) / 2**20, 1),
        "active_mib": round(memory["active_bytes"] / 2**20, 1),
        "cache_mib": round(memory.get("cache_bytes", 0) / 2**20, 1),
        "weights_mib": round(memory["weights_bytes"] / 2**20, 1),
        "prefix_mib": round(memory["prefix_cache_bytes"] / 2**20, 1),
        "reserved_mib": round(memory["reserved_bytes"] / 2**20, 1),
        "responses_mib": round(status["response_store"]["bytes"] / 2**20, 2),
        "rows": status["rows_in_flight"],
    }


def run(
    workdir: Path,
    corpus: Path,
    requests: int,
    concurrency: int,
    max_seconds: float,
    every: float,
    serve_args: list[str],
) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [sys.executable, "-m", "mlxkv", "serve", "--port", str(port), "--no-access-log"]
    cmd += ["--prefix-cache-dir", str(workdir / "prefixes"), *serve_args]
    server = ServerProcess("mlxkv serve", cmd, port, workdir / "serve.log", "")
    samples: list[dict] = []
    errors: list[str] = []
    kinds: dict[str, int] = {}
    try:
        server.wait_ready()
        server.model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        work = Workload(server.url, server.model, corpus)
        started = time.monotonic()
        deadline = started + max_seconds
        lock, state = threading.Lock(), {"next": 0, "done": 0}

        def client() -> None:
            while time.monotonic() < deadline:
                with lock:
                    i = state["next"]
                    if i >= requests:
                        return
                    state["next"] += 1
                try:
                    kind = work.send(i)
                except Exception as e:  # noqa: BLE001 - counted, the run goes on
                    kind = "error"
                    errors.append(f"request {i}: {e!r}"[:300])
                with lock:
                    state["done"] += 1
                    kinds[kind] = kinds.get(kind, 0) + 1

        threads = [threading.Thread(target=client) for _ in range(concurrency)]
        for t in threads:
            t.start()
        samples.append(sample(server, 0, started))
        while any(t.is_alive() for t in threads):
            time.sleep(every)
            samples.append(sample(server, state["done"], started))
            print(json.dumps(samples[-1]), flush=True)
        for t in threads:
            t.join()
        idle = sample(server, state["done"], started)
        for _ in range(120):  # dropped streams end at their next step
            if idle["rows"] == 0 and idle["reserved_mib"] == 0:
                break
            time.sleep(0.5)
            idle = sample(server, state["done"], started)
        samples.append(idle | {"idle": True})
    finally:
        server.stop()
    return {"samples": samples, "errors": errors, "kinds": kinds, "command": cmd}


def summary(result: dict) -> dict:
    """Resident memory after the warm-up (the first quarter of the requests) and at the
    end, its slope over the second half of the run, and MLX's active bytes at idle beyond
    weights + kept prefixes."""
    samples = [s for s in result["samples"] if not s.get("idle")]
    idle = result["samples"][-1]
    total = idle["requests"]
    warm = next((s for s in samples if s["requests"] >= total / 4), samples[0])
    half = [s for s in samples if s["requests"] >= total / 2] or samples[-1:]
    slope = _slope([s["requests"] for s in half], [s["rss_mib"] for s in half])
    return {
        "requests": total,
        "errors": len(result["errors"]),
        "seconds": idle["t_s"],
        "rss_start_mib": result["samples"][0]["rss_mib"],
        "rss_after_warmup_mib": warm["rss_mib"],
        "rss_max_mib": max(s["rss_mib"] for s in result["samples"]),
        "rss_idle_mib": idle["rss_mib"],
        "rss_slope_mib_per_100_requests": round(100 * slope, 2),
        "idle_active_beyond_weights_and_prefixes_mib": round(
            idle["active_mib"] - idle["weights_mib"] - idle["prefix_mib"], 1
        ),
        "idle_reserved_mib": idle["reserved_mib"],
        "prefix_mib_idle": idle["prefix_mib"],
        "responses_mib_idle": idle["responses_mib"],
    }


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two distinct xs)."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    covariance = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    return covariance / sum((x - mx) ** 2 for x in xs)
