"""``mlxkv serve`` against ``mlx_lm.server``: the same float32 weights, the same prompts,
1, 4 and 16 concurrent clients through the ``openai`` client, interleaved.

Both servers run at once (each in its own process, MLX routed to the same BLAS) and take
turns: for each client count, one then the other, the order swapped every round. Each
client streams its own prompts one after another (greedy, ``max_tokens`` each). Measured
per turn: aggregate generation tok/s (completion tokens of every request / wall time of
the turn), time to first token p50/p95 (request sent -> first text chunk), and the server
process's peak resident memory during the turn (Linux: VmHWM, reset before each turn).
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

TOPICS = [
    "the ocean", "mountains", "a city at night", "the history of bread", "robots",
    "winter", "friendship", "the moon", "trains", "gardening", "music", "coffee",
    "libraries", "rivers", "deserts", "birds", "volcanoes", "chess", "rain", "bridges",
    "clocks", "islands", "bees", "lighthouses", "maps", "glass", "kites", "salt",
    "forests", "snow", "ships", "paper",
]  # fmt: skip
MLX_LM_SERVER = (
    "import sys; from mlxkv.backend import setup_blas; setup_blas(); "
    "from mlx_lm.server import main; sys.argv[0] = 'mlx_lm.server'; main()"
)


def float32_copy(dst: Path) -> Path:
    """The default model with plain float32 weights, as a folder both servers load."""
    if (dst / "config.json").is_file():
        return dst
    from mlx_lm.utils import save_config, save_model

    from mlxkv.models.loader import load
    from mlxkv.models.resolve import resolve

    src = resolve(None).path
    loaded = load(src, dtype="float32")
    tmp = dst.with_name(dst.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(tmp, loaded.model)
    config = {k: v for k, v in loaded.config.items() if not k.startswith("quantization")}
    config["torch_dtype"] = "float32"
    save_config(config, tmp / "config.json")
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, tmp / f.name)
    tmp.rename(dst)
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# mlx.launch's ring ports (--starting-port, one per rank) come from here: below Linux's
# ephemeral range (32768-60999), so no outgoing connection is handed one of them between
# the check and the ranks' bind.
RING_PORTS = range(20000, 32000)


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive loopback ports that nothing listens on now."""
    for _ in range(100):
        base = random.randrange(RING_PORTS.start, RING_PORTS.stop - n)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} free consecutive ports in {RING_PORTS}")


class ServerProcess:
    def __init__(self, name: str, cmd: list[str], port: int, log: Path, model: str):
        self.name = name
        self.model = model  # what requests name
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 900) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not start in {timeout:.0f} s")

    def reset_peak(self) -> None:
        try:
            Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")
        except OSError:
            pass

    def peak_rss(self) -> int | None:
        return self._status_bytes("VmHWM:")

    def rss(self) -> int | None:
        return self._status_bytes("VmRSS:")

    def _status_bytes(self, field: str) -> int | None:
        """A memory figure of the process's /proc status (Linux), in bytes."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_servers(model: Path, workdir: Path, max_batch: int) -> list[ServerProcess]:
    p1, p2 = free_port(), free_port()
    mlxkv_cmd = [sys.executable, "-m", "mlxkv", "serve", str(model), "--port", str(p1)]
    mlxkv_cmd += ["--max-batch", str(max_batch), "--no-access-log"]
    mlx_lm_cmd = [sys.executable, "-c", MLX_LM_SERVER, "--model", str(model), "--port", str(p2)]
    mlx_lm_cmd += ["--log-level", "WARNING"]
    return [
        ServerProcess("mlxkv serve", mlxkv_cmd, p1, workdir / "mlxkv-serve.log", model.name),
        # mlx_lm.server loads the model a request names: name the one it has loaded
        ServerProcess("mlx_lm.server", mlx_lm_cmd, p2, workdir / "mlx_lm-server.log", str(model)),
    ]


def one_turn(server: ServerProcess, clients: int, prompts: list[str], max_tokens: int):
    """``clients`` threads stream ``prompts`` (split between them); the turn's figures."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=1800)
    ttfts: list[float] = []
    tokens: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()

    def worker(mine: list[str]) -> None:
        for prompt in mine:
            messages = [{"role": "user", "content": prompt}]
            try:
                first, pieces, usage = stream_chat(client, server.model, messages, max_tokens)
            except openai.OpenAIError as e:
                with lock:
                    errors.append(repr(e))
                continue
            with lock:
                ttfts.append(first)
                tokens.append(usage.completion_tokens if usage is not None else len(pieces))

    server.reset_peak()
    threads = [threading.Thread(target=worker, args=(prompts[i::clients],)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {
        "server": server.name,
        "clients": clients,
        "requests": len(ttfts),
        "errors": errors,
        "tokens": sum(tokens),
        "wall_s": round(wall, 3),
        "tok_s": round(sum(tokens) / wall, 3),
        "ttft_p50_s": round(_percentile(ttfts, 50), 3),
        "ttft_p95_s": round(_percentile(ttfts, 95), 3),
        "peak_rss_bytes": server.peak_rss(),
    }


def stream_chat(client, model: str, messages: list, max_tokens: int):
    """One greedy streamed chat answer: (seconds to the first text, the text pieces, the
    usage of the last chunk or None)."""
    t0 = time.perf_counter()
    first, pieces, usage = None, [], None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - t0
            pieces.append(ch.choices[0].delta.content)
        if ch.usage is not None:
            usage = ch.usage
    return (first if first is not None else time.perf_counter() - t0), pieces, usage


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def prompts_for(n: int) -> list[str]:
    return [f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


def run(
    workdir: Path,
    clients: tuple[int, ...] = (1, 4, 16),
    requests_per_client: int = 1,
    max_tokens: int = 64,
    rounds: int = 1,
    max_batch: int = 16,
    on_turn=print,
) -> list[dict]:
    """Every turn's figures, in the order run."""
    workdir.mkdir(parents=True, exist_ok=True)
    model = float32_copy(workdir / "smollm2-135m-float32")
    servers = start_servers(model, workdir, max_batch)
    turns = []
    try:
        for s in servers:
            s.wait_ready()
        for s in servers:  # warm up: one short answer each
            one_turn(s, 1, prompts_for(1), 4)
        for r in range(rounds):
            for c in clients:
                for s in servers if r % 2 == 0 else servers[::-1]:
                    turn = one_turn(s, c, prompts_for(c * requests_per_client), max_tokens)
                    turn["round"] = r
                    on_turn(json.dumps(turn))
                    turns.append(turn)
    finally:
        for s in servers:
            s.stop()
    return turns


def table(turns: list[dict]) -> str:
    """Medians over rounds, mlxkv beside mlx_lm.server, with the ratios the goal names."""
    rows = [
        "| clients | server | gen tok/s | TTFT p50 (s) | TTFT p95 (s) | peak RSS (MiB) | tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for c in sorted({t["clients"] for t in turns}):
        med = {}
        for name in ("mlxkv serve", "mlx_lm.server"):
            mine = [t for t in turns if t["clients"] == c and t["server"] == name]
            if not mine:
                continue
            m = {
                k: statistics.median(t[k] for t in mine)
                for k in ("tok_s", "ttft_p50_s", "ttft_p95_s", "tokens")
            }
            peaks = [t["peak_rss_bytes"] for t in mine if t["peak_rss_bytes"]]
            rss = f"{max(peaks) / 2**20:.0f}" if peaks else "n/a"
            med[name] = m
            rows.append(
                f"| {c} | {name} | {m['tok_s']:.1f} | {m['ttft_p50_s']:.2f} | "
                f"{m['ttft_p95_s']:.2f} | {rss} | {m['tokens']:.0f} |"
            )
        if len(med) == 2:
            a, b = med["mlxkv serve"], med["mlx_lm.server"]
            ratios.append(
                f"- {c} client(s): tok/s {a['tok_s'] / b['tok_s']:.2f}x mlx_lm.server, "
                f"TTFT p95 {a['ttft_p95_s']:.2f} s vs {b['ttft_p95_s']:.2f} s"
            )
    return "\n".join(rows + [""] + ratios)
