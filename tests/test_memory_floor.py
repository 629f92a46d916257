"""The machine's free memory kept above a floor: under it the scheduler gives kept prefixes
back (to disk, least recently used first) and starts a request beside running ones only
where its KV fits above it; a request alone always starts. The engine tests read a gauge
the test sets (the same ``MemoryGauge`` protocol as the system's); the last test reads the
real one while another process takes memory."""

from __future__ import annotations

import subprocess
import sys
import time

import mlx.core as mx
import pytest

from mlxkv.engine.admission import MemoryBudget
from mlxkv.engine.events import Finished
from mlxkv.engine.prefix_cache import DiskTier, PrefixCache
from mlxkv.engine.pressure import MemoryFloor, default_floor
from mlxkv.engine.request import GenerationSettings
from mlxkv.engine.reuse import cache_identity
from mlxkv.engine.scheduler import Request, Scheduler
from mlxkv.memory.budget import human_bytes
from mlxkv.memory.system import MemoryGauge, SystemGauge, SystemMemory, mac_free
from mlxkv.policy import KVPolicy

GiB = 2**30
FLOOR = 2 * GiB


class SetGauge:
    """A machine whose free memory the test sets."""

    def __init__(self, free: int):
        self.free_bytes = free

    def free(self) -> SystemMemory | None:
        return SystemMemory(self.free_bytes, 16 * GiB, "set by the test")


def _gauges_share_a_protocol(g: MemoryGauge) -> MemoryGauge:
    return g


def _scheduler(model, gauge, tmp_path, lines):
    disk = DiskTier(tmp_path / "prefixes", 1 << 30, cache_identity(model), lines.append)
    return Scheduler(
        model,
        KVPolicy(),
        max_batch=4,
        prefix_cache=PrefixCache(1 << 30, model.model, disk, lines.append),
        memory=MemoryBudget(model, 1 << 40, 4, 512),
        floor=MemoryFloor(_gauges_share_a_protocol(gauge), FLOOR, lines.append, every=0.0),
    )


def _answer(scheduler, ids, max_tokens=6) -> Finished:
    h = scheduler.submit(Request(ids, GenerationSettings(max_tokens=max_tokens)))
    return next(e for e in h.events() if isinstance(e, Finished))


def _prompt(scheduler, topic: str) -> list[int]:
    return scheduler.encode(f"Write two sentences about {topic}. " * 6)


@pytest.mark.model
def test_under_the_floor_kept_prefixes_go_to_disk_oldest_first(default_model, tmp_path):
    """Two finished requests are kept in memory; when the machine's free memory falls
    under the floor by less than the newer entry, the older one goes to disk and the newer
    stays; a repeat of the older request is then answered from disk, as it was answered."""
    lines: list[str] = []
    gauge = SetGauge(64 * GiB)
    s = _scheduler(default_model, gauge, tmp_path, lines)
    first, second = _prompt(s, "rivers"), _prompt(s, "mountains")
    answer = _answer(s, first)
    _answer(s, second)
    older, newer = s.prefix.entries
    assert older.tokens[: len(first)] == first and s.prefix.disk.files == {}
    gauge.free_bytes = FLOOR - newer.nbytes // 2
    mx.clear_cache()  # MLX's freed buffers, given back first, would cover part of it
    s.step()
    assert s.prefix.entries == [newer]
    assert [f.tokens for f in s.prefix.disk.files.values()] == [older.tokens]
    machine = s.status()["machine_memory"]
    assert machine["under_floor"] is True and machine["times_under"] == 1
    assert machine["given_back_bytes"] >= older.nbytes
    assert machine["free_bytes"] == FLOOR - newer.nbytes // 2
    assert lines == [
        f"the machine has 2.0 GiB free, {human_bytes(newer.nbytes // 2)} under the floor of "
        f"2.0 GiB (--memory-floor): gave back {human_bytes(machine['given_back_bytes'])} (1 kept "
        "prefix to disk and MLX's freed buffers); a new request starts beside running ones "
        "only where its KV fits above the floor"
    ]

    gauge.free_bytes = 64 * GiB
    again = _answer(s, first)
    assert again.stats.prompt_tokens_cached == len(first) - 1
    assert s.prefix.disk.hits == 1
    assert again.text == answer.text
    assert s.status()["machine_memory"]["under_floor"] is False
    assert "free again, above the floor" in lines[-1]


@pytest.mark.model
def test_without_a_disk_tier_a_prefix_given_back_is_dropped_and_said_so(default_model):
    lines: list[str] = []
    gauge = SetGauge(64 * GiB)
    s = Scheduler(
        default_model,
        KVPolicy(),
        prefix_cache=PrefixCache(1 << 30, default_model.model, None, lines.append),
        memory=MemoryBudget(default_model, 1 << 40, 4, 512),
        floor=MemoryFloor(gauge, FLOOR, lines.append, every=0.0),
    )
    _answer(s, _prompt(s, "rivers"), max_tokens=2)
    assert len(s.prefix.entries) == 1
    gauge.free_bytes = FLOOR - 1
    mx.clear_cache()  # MLX's freed buffers, given back first, would cover it
    s.step()
    assert s.prefix.entries == [] and s.prefix.nbytes == 0
    assert "(1 kept prefix dropped and MLX's freed buffers)" in lines[0]


@pytest.mark.model
@pytest.mark.parametrize("free", [64 * GiB, FLOOR + 2**20])
def test_a_request_starts_beside_another_only_where_its_kv_fits_above_the_floor(
    default_model, tmp_path, free
):
    """With room above the floor two requests decode as one batch; with 1 MiB above it
    (less than one reservation) the second waits for the first to end, and both finish."""
    s = _scheduler(default_model, SetGauge(free), tmp_path, [])
    order: list[tuple[int, str]] = []  # (request, event) as they came

    def seen(i: int):
        return lambda e: order.append((i, type(e).__name__))

    settings = GenerationSettings(max_tokens=6)
    handles = [
        s.submit(Request(_prompt(s, t), settings, sink=seen(i)))
        for i, t in enumerate(("rivers", "mountains"))
    ]
    while not all(h.done for h in handles):
        s.step()
    first_of_second = order.index((1, "TokenDelta"))
    end_of_first = order.index((0, "Finished"))
    if free > FLOOR + 2**20:
        assert s.max_rows_in_a_step == 2 and first_of_second < end_of_first
    else:
        assert s.max_rows_in_a_step == 1 and first_of_second > end_of_first
    assert [order.count((i, "Finished")) for i in (0, 1)] == [1, 1]


def test_the_default_floor_is_a_tenth_of_the_machine_within_1_to_8_gib():
    assert default_floor(16 * GiB) == int(1.6 * GiB)
    assert default_floor(4 * GiB) == GiB
    assert default_floor(512 * GiB) == 8 * GiB
    assert default_floor(None) == GiB
    assert default_floor(2 * GiB) == GiB // 2  # a small machine keeps a quarter free


def test_a_macs_free_memory_is_its_memorystatus_level_of_its_ram():
    got = mac_free(37, 16 * GiB)
    assert got == SystemMemory(16 * GiB * 37 // 100, 16 * GiB, "kern.memorystatus_level")
    assert mac_free(None, 16 * GiB) is None
    assert mac_free(101, 16 * GiB) is None
    assert mac_free(50, None) is None


HOG = """
import mmap, sys
flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE  # every page resident
block = mmap.mmap(-1, int(sys.argv[1]), flags=flags)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/meminfo")
def test_the_system_gauge_sees_another_process_take_memory():
    """A process that writes 3 GiB takes most of that from the machine's free memory, and
    gives it back when it ends (the other tests' processes come and go meanwhile)."""
    gauge = SystemGauge("cpu")
    before = gauge.free().available
    if before < 8 * GiB:
        pytest.skip(f"{before / GiB:.1f} GiB free: too little to take 3 GiB of it")
    hog = subprocess.Popen(
        [sys.executable, "-c", HOG, str(3 * GiB)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert hog.stdout.readline().strip() == "held"
        during = gauge.free().available
    finally:
        hog.communicate("", timeout=30)
    deadline = time.monotonic() + 10
    while (after := gauge.free().available) < before - GiB and time.monotonic() < deadline:
        time.sleep(0.1)
    # the kernel's MemAvailable is an estimate: 3 GiB written here took 2.1 GiB from it
    assert before - during > 1.5 * GiB
    assert after - during > 1.5 * GiB


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/meminfo")
def test_a_server_gives_its_prefixes_back_when_another_process_takes_memory(tmp_path):
    """A real server keeps a floor 6 GiB under what the machine has free; a conversation's
    turn is kept in memory. Another process then writes 12 GiB: the server finds the
    machine under its floor, moves the turn to disk and says so; once that process ends,
    the machine is above the floor again and the next turn is answered from the file."""
    from tests.serve_helpers import Server

    free = SystemGauge("cpu").free().available
    if free < 16 * GiB:
        pytest.skip(f"{free / GiB:.1f} GiB free: too little to take 12 GiB of it")
    floor = free - 6 * GiB
    s = Server(tmp_path, "--memory-floor", str(floor))
    hog = None
    try:
        messages = [{"role": "user", "content": "Name three rivers of Europe."}]
        r = s.client().chat.completions.create(
            model="smollm2-135m", messages=messages, max_tokens=12, temperature=0
        )

        def machine() -> dict:
            status = s.http("GET", "/v1/status").json()
            return {**status["machine_memory"], **status["prefix_cache"]}

        held = machine()
        assert held["entries"] == 1 and held["disk"]["entries"] == 0
        assert held["under_floor"] is False and held["floor_bytes"] == floor

        hog = subprocess.Popen(
            [sys.executable, "-c", HOG, str(12 * GiB)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert hog.stdout.readline().strip() == "held"
        deadline = time.monotonic() + 20
        while not (now := machine())["under_floor"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert now["under_floor"] is True and now["times_under"] == 1
        assert now["entries"] == 0 and now["disk"]["entries"] == 1
        assert now["given_back_bytes"] >= held["bytes"]
        assert "under the floor" in s.log() and "1 kept prefix to disk" in s.log()
        hog.communicate("", timeout=30)
        hog = None
        deadline = time.monotonic() + 20
        while (now := machine())["under_floor"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert now["under_floor"] is False and "free again, above the floor" in s.log()

        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "And one more?"},
        ]
        again = s.client().chat.completions.create(
            model="smollm2-135m", messages=messages, max_tokens=4, temperature=0
        )
        assert again.usage.prompt_tokens_details.cached_tokens > r.usage.prompt_tokens
        assert machine()["disk"]["hits"] == 1
    finally:
        if hog is not None:
            hog.kill()
        assert s.stop() == 0, s.log()
    assert "Traceback" not in s.log()
