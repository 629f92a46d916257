"""What ``GET /metrics`` exports and ``mlxkv top`` draws from a status dict: the figures,
the bar, the text, and the older status without the memory section (no server, no model)."""

from __future__ import annotations

import argparse

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlxkv.server import metrics, observe
from tests.tui_pilot import sync
from tui import top, top_client, top_view

MiB = 2**20

STATUS = {  # the schema of GET /v1/status with the memory and prefix cache sections
    "model": "smollm2-135m",
    "policy": "full",
    "max_batch": 16,
    "rows_in_flight": 3,
    "draining": False,
    "running": [
        {
            "id": 7,
            "policy": "sink 4 + window 16",
            "prompt_tokens": 40,
            "prompt_tokens_cached": 32,
            "generated": 5,
            "kv_bytes": 3 * MiB,
            "kv_bytes_predicted": 3 * MiB,
            "reserved_bytes": 4 * MiB,
            "batch_rows": 2,
        },
        {
            "id": 8,
            "policy": "sink 4 + window 16",
            "prompt_tokens": 12,
            "prompt_tokens_cached": 0,
            "generated": 9,
            "kv_bytes": 3 * MiB,
            "kv_bytes_predicted": 3 * MiB,
            "reserved_bytes": 2 * MiB,
            "batch_rows": 2,
        },
    ],
    "prefilling": 1,
    "waiting": 3,
    "queue": [
        {"id": 9, "policy": "full", "prompt_tokens": 100, "reserved_bytes": 5 * MiB},
        {"id": 10, "policy": "full", "prompt_tokens": 7, "reserved_bytes": MiB},
    ],
    "groups": [{"policy": "sink 4 + window 16", "rows": 2}],
    "max_rows_in_a_step": 2,
    "steps": 123,
    "requests_finished": 4,
    "tokens_generated": 250,
    "draft_tokens": 90,
    "draft_tokens_accepted": 60,
    "prompt_tokens_prefilled": 900,
    "prompt_tokens_cached": 320,
    "tokens_per_second": 12.5,
    "memory": {
        "budget_bytes": 100 * MiB,
        "weights_bytes": 50 * MiB,
        "runtime_bytes": 10 * MiB,
        "reserved_bytes": 20 * MiB,
        "prefix_cache_bytes": 10 * MiB,
        "kv_bytes_actual": 3 * MiB,
        "kv_bytes_predicted": 3 * MiB + 512,
        "active_bytes": 70 * MiB,
        "peak_bytes": 80 * MiB,
        "cache_bytes": 6 * MiB,
    },
    "prefix_cache": {
        "entries": 2,
        "bytes": 10 * MiB,
        "limit_bytes": 64 * MiB,
        "hits": 3,
        "misses": 4,
        "tokens_reused": 320,
        "disk": {"entries": 5, "bytes": 40 * MiB, "limit_bytes": 0, "hits": 1, "dir": "/tmp/p"},
    },
    "refused": {"busy": 2, "too_large": 1},
}

OLD_STATUS = {  # a status without memory, queue, counters and prefix cache sections
    "model": "smollm2-135m",
    "policy": "full",
    "running": [
        {"id": 1, "policy": "full", "prompt_tokens": 9, "generated": 2, "kv_bytes": 1000,
         "batch_rows": 2},
        {"id": 2, "policy": "full", "prompt_tokens": 9, "generated": 3, "kv_bytes": 1000,
         "batch_rows": 2},
        {"id": 3, "policy": "4-bit", "prompt_tokens": 5, "generated": 1, "kv_bytes": 301,
         "batch_rows": 1},
    ],
    "prefilling": 0,
    "waiting": 0,
    "steps": 9,
    "requests_finished": 1,
}  # fmt: skip


def test_view_reads_every_section():
    v = top_view.view(STATUS)
    assert [r.id for r in v.running] == [7, 8]
    r = v.running[0]
    assert (r.policy, r.prompt_tokens, r.prompt_tokens_cached, r.generated) == (
        "sink 4 + window 16",
        40,
        32,
        5,
    )
    assert (r.kv_bytes, r.kv_bytes_predicted, r.reserved_bytes, r.batch_rows) == (
        3 * MiB,
        3 * MiB,
        4 * MiB,
        2,
    )
    assert [(q.id, q.prompt_tokens, q.reserved_bytes) for q in v.queue] == [
        (9, 100, 5 * MiB),
        (10, 7, MiB),
    ]
    assert (v.waiting, v.prefilling) == (3, 1)
    b = v.bar
    assert (b.weights, b.runtime, b.reserved, b.kv, b.prefixes, b.budget) == (
        50 * MiB,
        10 * MiB,
        20 * MiB,
        3 * MiB,
        10 * MiB,
        100 * MiB,
    )
    assert (b.unused, b.used, b.free) == (17 * MiB, 90 * MiB, 10 * MiB)
    # 3 hits, one of them read from disk first, and 4 misses: 7 lookups
    assert (v.memory.entries, v.memory.bytes, v.memory.hits, v.memory.hit_ratio) == (
        2,
        10 * MiB,
        2,
        2 / 7,
    )
    assert (v.disk.entries, v.disk.bytes, v.disk.hits, v.disk.hit_ratio) == (5, 40 * MiB, 1, 1 / 7)
    assert (v.misses, v.tokens_reused, v.disk_dir) == (4, 320, "/tmp/p")
    assert v.tokens_per_second == 12.5
    assert v.counters == {
        "requests_finished": 4,
        "prompt_tokens_prefilled": 900,
        "prompt_tokens_cached": 320,
        "tokens_generated": 250,
        "draft_tokens": 90,
        "draft_tokens_accepted": 60,
        "steps": 123,
    }
    assert v.refused == {"busy": 2, "too_large": 1}


def test_view_of_a_status_without_the_new_sections():
    v = top_view.view(OLD_STATUS)
    assert [r.first_in_batch for r in v.running] == [True, False, True]
    # the batch of two rows is counted once: 1000 + 301
    assert (v.kv_bytes_actual, v.kv_bytes_predicted, v.bar.reserved) == (1301, 0, 0)
    assert v.bar.budget is None and v.bar.free is None
    assert v.queue == [] and v.waiting == 0
    assert (v.memory.hits, v.memory.hit_ratio, v.disk.hit_ratio, v.misses) == (0, 0.0, 0.0, 0)
    assert v.counters["tokens_generated"] == 0 and v.counters["requests_finished"] == 1
    assert v.tokens_per_second == 0.0


def test_view_of_nonsense_reads_zeros():
    v = top_view.view(
        {
            "running": [{"id": "x", "kv_bytes": None}, 3],
            "memory": {"budget_bytes": True},
            "prefix_cache": {"hits": 2, "disk": [1]},
            "refused": [],
            "queue": {"id": 1},
        }
    )
    assert [(r.id, r.kv_bytes, r.batch_rows) for r in v.running] == [(0, 0, 1)]
    assert v.bar.budget is None
    assert (v.memory.hits, v.disk.hits, v.queue) == (2, 0, [])
    assert v.refused == {"busy": 0, "too_large": 0}


def test_view_of_numbers_past_a_float_reads_zeros():
    """NaN, an infinity or an integer past a float's range (JSON another server may send):
    `mlxkv top` crashed on int(NaN)."""
    v = top_view.view(
        {
            "running": [{"id": "x", "kv_bytes": float("nan"), "prompt_tokens": 10**400}],
            "memory": {"budget_bytes": float("inf"), "kv_bytes_actual": float("nan")},
            "tokens_per_second": float("-inf"),
        }
    )
    assert [(r.kv_bytes, r.prompt_tokens) for r in v.running] == [(0, 10**400)]
    assert v.bar.budget is None and v.tokens_per_second == 0.0
    assert observe.real({"x": 10**400}, "x") == 0.0


def test_bar_cells_follow_the_budget():
    # 100 MiB over 20 cells: weights 10, runtime 2, KV 1 (3 MiB rounds to 0.6), reserved
    # unused 3 (17 MiB), prefixes 2, free 2
    cells = top_view.bar_cells(top_view.view(STATUS).bar, 20)
    assert cells == (
        ["blue"] * 10
        + ["yellow"] * 2
        + ["bold cyan"]
        + ["dark_cyan"] * 3
        + ["magenta"] * 2
        + [top_view.FREE] * 2
    )


def test_bar_cells_without_a_budget_leave_a_quarter_free():
    bar = top_view.MemoryBar(weights=80, runtime=0, reserved=0, kv=0, prefixes=0, budget=None)
    assert top_view.bar_cells(bar, 10) == ["blue"] * 8 + [top_view.FREE] * 2


def test_bar_over_budget_is_cut_at_the_width_and_said():
    bar = top_view.MemoryBar(weights=90, runtime=0, reserved=30, kv=30, prefixes=0, budget=100)
    assert top_view.bar_cells(bar, 10) == ["blue"] * 9 + ["bold cyan"]
    v = top_view.view(STATUS)
    v.bar = bar
    assert "over by 20 B of budget 100 B" in top_view.memory_text(v, 10).plain


def test_texts_a_user_reads():
    v = top_view.view(STATUS)
    mem = top_view.memory_text(v, 20).plain.splitlines()
    assert mem[1:] == [
        "weights 50.0 MiB  runtime 10.0 MiB  reserved 20.0 MiB (KV 3.0 MiB)",
        "prefixes 10.0 MiB  free 10.0 MiB of budget 100 MiB",
        "KV actual 3.0 MiB · predicted 3.0 MiB (actual -512 B (-0.0%))",
        "MLX active 70.0 MiB · peak 80.0 MiB · cache 6.0 MiB",
    ]
    assert max(len(line) for line in mem[1:]) <= 80
    running = top_view.requests_text(v).plain.splitlines()
    assert running[0] == "Running 2 · prefilling 1"
    assert running[1] == top_view.REQUEST_HEAD
    assert running[2:] == [
        "    7      40      32      5    3.0 MiB    3.0 MiB    4.0 MiB  sink 4 + window 16 · "
        "batch of 2",
        "    8      12       0      9          ″          ″    2.0 MiB  sink 4 + window 16",
    ]
    queue = top_view.queue_text(v, rows=1).plain.splitlines()
    assert queue == [
        "Queue 3 waiting · refused 2 busy, 1 too large",
        top_view.QUEUE_HEAD,
        "    9     100    5.0 MiB  full",
        "      … 2 more",
    ]
    cache = top_view.cache_text(v).plain.splitlines()
    assert cache[2] == "memory         2   10.0 MiB   64.0 MiB       2     28.6%"
    assert cache[3] == "disk           5   40.0 MiB          -       1     14.3%"
    assert cache[4] == "misses 4 · tokens reused 320 · disk /tmp/p"
    assert top_view.header(v, "http://h:1").plain == (
        "smollm2-135m at http://h:1 · policy full · 12.5 tok/s"
    )
    running = {"id": "batch_1", "total": 40, "completed": 11, "failed": 1}
    in_batch = top_view.view({**STATUS, "batches": {"running": running, "waiting": 0}})
    assert top_view.header(in_batch, "http://h:1").plain == (
        "smollm2-135m at http://h:1 · policy full · 12.5 tok/s · batch 12 of 40 answered"
    )
    assert top_view.totals_text(v).plain.splitlines() == [
        "Since start 4 requests finished · 250 tokens generated · 123 steps · 60 of 90 drafts "
        "taken",
        "Prompt tokens 900 prefilled, 320 from a cache",
    ]
    old = top_view.totals_text(top_view.view(OLD_STATUS)).plain.splitlines()
    assert old[0] == "Since start 1 requests finished · 0 tokens generated · 9 steps"  # no drafts


def scrape(status: dict) -> dict[tuple[str, tuple], float]:
    body, content_type = metrics.exposition(metrics.registry(lambda: status))
    assert content_type.startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def test_metrics_read_the_status():
    m = scrape(STATUS)
    expected = {
        "mlxkv_memory_budget_bytes": 100 * MiB,
        "mlxkv_kv_bytes_actual": 3 * MiB,
        "mlxkv_kv_bytes_predicted": 3 * MiB + 512,
        "mlxkv_reserved_bytes": 20 * MiB,
        "mlxkv_weights_bytes": 50 * MiB,
        "mlxkv_runtime_bytes": 10 * MiB,
        "mlxkv_active_bytes": 70 * MiB,
        "mlxkv_peak_bytes": 80 * MiB,
        "mlxkv_cache_bytes": 6 * MiB,
        "mlxkv_requests_waiting": 3,
        "mlxkv_requests_running": 3,  # two decoding, one prefilling
        "mlxkv_tokens_per_second": 12.5,
        "mlxkv_requests_finished_total": 4,
        "mlxkv_prompt_tokens_prefilled_total": 900,
        "mlxkv_prompt_tokens_cached_total": 320,
        "mlxkv_tokens_generated_total": 250,
        "mlxkv_scheduler_steps_total": 123,
        "mlxkv_prefix_cache_misses_total": 4,
        "mlxkv_prefix_cache_tokens_reused_total": 320,
    }
    for name, value in expected.items():
        assert m[(name, ())] == value, name
    tiered = {
        "mlxkv_prefix_cache_entries": (2, 5),
        "mlxkv_prefix_cache_bytes": (10 * MiB, 40 * MiB),
        "mlxkv_prefix_cache_limit_bytes": (64 * MiB, 0),
        "mlxkv_prefix_cache_hits_total": (2, 1),
        "mlxkv_prefix_cache_hit_ratio": (2 / 7, 1 / 7),
    }
    for name, (memory, disk) in tiered.items():
        assert m[(name, (("tier", "memory"),))] == memory, name
        assert m[(name, (("tier", "disk"),))] == disk, name
    assert m[("mlxkv_server_info", (("model", "smollm2-135m"), ("policy", "full")))] == 1
    assert m[("mlxkv_requests_refused_total", (("reason", "busy"),))] == 2
    assert m[("mlxkv_requests_refused_total", (("reason", "too_large"),))] == 1
    assert m[("mlxkv_batches_waiting", ())] == 0
    assert m[("mlxkv_batch_requests", (("state", "total"),))] == 0
    running = {"id": "batch_1", "total": 40, "completed": 11, "failed": 1}
    batches = {"running": running, "waiting": 2, "requests_in_flight": 15}
    m = scrape({**STATUS, "batches": batches})
    assert m[("mlxkv_batches_waiting", ())] == 2
    states = ("in_flight", "answered", "total")
    got = {state: m[("mlxkv_batch_requests", (("state", state),))] for state in states}
    assert got == {"in_flight": 15, "answered": 12, "total": 40}


def test_metrics_of_a_status_without_the_new_sections():
    m = scrape(OLD_STATUS)
    assert m[("mlxkv_kv_bytes_actual", ())] == 1301
    assert m[("mlxkv_requests_running", ())] == 3
    assert m[("mlxkv_requests_finished_total", ())] == 1
    assert m[("mlxkv_tokens_generated_total", ())] == 0
    assert ("mlxkv_memory_budget_bytes", ()) not in m  # no budget: no sample


@pytest.mark.parametrize(
    "given, url",
    [
        ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
        ("http://127.0.0.1:8080/v1/", "http://127.0.0.1:8080"),
        ("localhost:9000", "http://localhost:9000"),
        (" https://box.lan/ ", "https://box.lan"),
    ],
)
def test_base_url(given, url):
    assert top_client.base_url(given) == url


def answer(code: int, body, key: str | None = None) -> httpx.Response:
    request = httpx.Request("GET", "http://h:1/v1/status", headers=top_client.headers(key))
    if isinstance(body, bytes):
        return httpx.Response(code, content=body, request=request)
    return httpx.Response(code, json=body, request=request)


@pytest.mark.parametrize(
    "response, message",
    [
        (answer(404, {"detail": "Not Found"}), "http://h:1 is not an mlxkv server: GET /v1/status "
         "answered HTTP 404"),
        (answer(200, b"<html>hello</html>"), "http://h:1 is not an mlxkv server: GET /v1/status "
         "has no scheduler status"),
        (answer(200, {"status": "ok"}), "http://h:1 is not an mlxkv server: GET /v1/status has "
         "no scheduler status"),
        (answer(401, {}), "http://h:1 wants an API key: give it with --api-key or MLXKV_API_KEY"),
        (answer(401, {}, key="k"), "http://h:1 refused the API key (HTTP 401)"),
    ],
)  # fmt: skip
def test_read_status_refuses_what_is_not_mlxkv(response, message):
    with pytest.raises(top_client.Unreachable) as e:
        top_client.read_status(response, "http://h:1")
    assert str(e.value) == message


def test_read_status_takes_a_status():
    assert top_client.read_status(answer(200, OLD_STATUS), "http://h:1") == OLD_STATUS


@pytest.mark.parametrize("text", ["0", "-1", "abc", "1e9"])
def test_interval_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError):
        top._interval(text)


def shown(app, selector: str) -> str:
    return str(app.query_one(selector).content)


@sync
async def test_app_draws_the_status_and_says_when_the_server_is_gone():
    """The first status is drawn at once; polls of a port nothing listens on put the
    "disconnected, retrying" line under the last figures, and q quits with status 0."""
    from tui.top_app import TopApp

    app = TopApp("http://127.0.0.1:1", None, 0.1, STATUS)
    async with app.run_test(size=(120, 40)) as pilot:
        assert "sink 4 + window 16 · batch of 2" in shown(app, "#top-running")
        assert "reserved 20.0 MiB (KV 3.0 MiB)" in shown(app, "#top-mem")
        for _ in range(50):
            await pilot.pause(0.1)
            if not app.connected:
                break
        assert shown(app, "#top-conn") == (
            "disconnected, retrying every 0.1 s: cannot connect to http://127.0.0.1:1 "
            "(is mlxkv serve running there?)"
        )
        assert "sink 4 + window 16 · batch of 2" in shown(app, "#top-running")  # kept
        assert app.return_code is None
        await pilot.press("q")
        await pilot.pause(0.1)
        assert app.return_code == 0 and not app.is_running


def test_the_machine_against_its_floor_in_metrics_and_top():
    """A server that keeps a floor exports the machine's free memory, its floor, whether it
    is under it, and what was given back; ``mlxkv top`` says it under the KV figures, in
    red while under; a server without one (or an older one) exports none of it."""
    machine = {
        "free_bytes": 900 * MiB,
        "floor_bytes": 1024 * MiB,
        "under_floor": True,
        "times_under": 2,
        "given_back_bytes": 300 * MiB,
    }
    m = scrape({**STATUS, "machine_memory": machine})
    assert m[("mlxkv_machine_free_bytes", ())] == 900 * MiB
    assert m[("mlxkv_machine_floor_bytes", ())] == 1024 * MiB
    assert m[("mlxkv_machine_under_floor", ())] == 1
    assert m[("mlxkv_machine_times_under_floor_total", ())] == 2
    assert m[("mlxkv_machine_given_back_bytes_total", ())] == 300 * MiB
    assert not [k for k in scrape(STATUS) if k[0].startswith("mlxkv_machine")]

    text = top_view.memory_text(top_view.view({**STATUS, "machine_memory": machine}), 20)
    last = text.plain.splitlines()[-1]
    assert last == "machine free 900 MiB · floor 1.0 GiB · under the floor · given back 300 MiB"
    assert any(span.style == "bold red" for span in text.spans)
    calm = {**machine, "under_floor": False, "free_bytes": 3 * 1024 * MiB, "given_back_bytes": 0}
    text = top_view.memory_text(top_view.view({**STATUS, "machine_memory": calm}), 20)
    assert text.plain.splitlines()[-1] == "machine free 3.0 GiB · floor 1.0 GiB"
    plain = top_view.memory_text(top_view.view(STATUS), 20).plain
    assert "machine" not in plain
