"""What ``mlxkv top`` shows, from one ``GET /v1/status`` answer: plain figures first
(:func:`view`, unit-tested), then the rich text drawn from them (no I/O, no Textual)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.text import Text

from mlxkv.server import observe
from tui.fmt import human_bytes, tokens, versus

BAR = "█"
# the memory bar's parts, in order: (MemoryBar attribute, colour)
PARTS = (
    ("weights", "blue"),
    ("runtime", "yellow"),
    ("kv", "bold cyan"),
    ("unused", "dark_cyan"),
    ("prefixes", "magenta"),
)
FREE = "grey23"


@dataclass
class RequestRow:
    id: int
    policy: str
    prompt_tokens: int
    prompt_tokens_cached: int
    generated: int
    kv_bytes: int  # the batch's bytes (shared by its batch_rows rows)
    kv_bytes_predicted: int
    reserved_bytes: int
    batch_rows: int
    first_in_batch: bool = True  # the batch's bytes are shown on its first row only


@dataclass
class QueueRow:
    id: int
    policy: str
    prompt_tokens: int
    reserved_bytes: int


@dataclass
class MemoryBar:
    """The parts the admission rule adds up, against the budget (None: no budget set).
    The reservations are drawn as the KV the running requests hold and the part of their
    reservations they do not hold yet (KV past its reservation is drawn whole)."""

    weights: int
    runtime: int
    reserved: int
    kv: int  # KV bytes MLX holds for the running requests
    prefixes: int
    budget: int | None

    @property
    def unused(self) -> int:
        return max(self.reserved - self.kv, 0)

    @property
    def used(self) -> int:
        return self.weights + self.runtime + self.kv + self.unused + self.prefixes

    @property
    def free(self) -> int | None:
        return None if self.budget is None else self.budget - self.used


@dataclass
class Tier:
    entries: int
    bytes: int
    limit_bytes: int
    hits: int
    hit_ratio: float


@dataclass
class TopView:
    model: str
    policy: str
    running: list[RequestRow]
    queue: list[QueueRow]
    waiting: int  # all waiting requests (the queue lists the first ones)
    prefilling: int
    bar: MemoryBar
    kv_bytes_actual: int
    kv_bytes_predicted: int
    active_bytes: int
    peak_bytes: int
    cache_bytes: int  # freed buffers MLX keeps for reuse
    memory: Tier
    disk: Tier
    disk_dir: str | None
    misses: int
    tokens_reused: int
    tokens_per_second: float
    counters: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    draining: bool = False
    batch: tuple[int, int] | None = None  # the running batch's requests answered, in all
    machine: dict | None = None  # the machine's free memory against the floor (None: none)


def view(status: dict) -> TopView:
    """The figures ``mlxkv top`` draws from a status dict (missing keys read as 0)."""
    mem = observe.memory(status)
    cache = observe.prefix_cache(status)
    running = [
        RequestRow(
            id=observe.integer(r, "id"),
            policy=str(r.get("policy", "")),
            prompt_tokens=observe.integer(r, "prompt_tokens"),
            prompt_tokens_cached=observe.integer(r, "prompt_tokens_cached"),
            generated=observe.integer(r, "generated"),
            kv_bytes=observe.integer(r, "kv_bytes"),
            kv_bytes_predicted=observe.integer(r, "kv_bytes_predicted"),
            reserved_bytes=observe.integer(r, "reserved_bytes"),
            batch_rows=max(observe.integer(r, "batch_rows"), 1),
        )
        for r in observe.running(status)
    ]
    left = 0  # rows of the current batch still to come (a batch's rows are listed together)
    for r in running:
        r.first_in_batch = left == 0
        left = (r.batch_rows if left == 0 else left) - 1
    queue = [
        QueueRow(
            id=observe.integer(q, "id"),
            policy=str(q.get("policy", "")),
            prompt_tokens=observe.integer(q, "prompt_tokens"),
            reserved_bytes=observe.integer(q, "reserved_bytes"),
        )
        for q in observe.queue(status)
    ]

    def tier(name: str) -> Tier:
        t = cache[name]
        return Tier(t["entries"], t["bytes"], t["limit_bytes"], t["hits"], t["hit_ratio"])

    return TopView(
        model=str(status.get("model", "")),
        policy=str(status.get("policy", "")),
        running=running,
        queue=queue,
        waiting=observe.waiting(status),
        prefilling=observe.integer(status, "prefilling"),
        bar=MemoryBar(
            weights=mem["weights_bytes"],
            runtime=mem["runtime_bytes"],
            reserved=mem["reserved_bytes"],
            kv=mem["kv_bytes_actual"],
            prefixes=mem["prefix_cache_bytes"],
            budget=mem["budget_bytes"],
        ),
        kv_bytes_actual=mem["kv_bytes_actual"],
        kv_bytes_predicted=mem["kv_bytes_predicted"],
        active_bytes=mem["active_bytes"],
        peak_bytes=mem["peak_bytes"],
        cache_bytes=mem["cache_bytes"],
        memory=tier("memory"),
        disk=tier("disk"),
        disk_dir=cache["disk"]["dir"],
        misses=cache["misses"],
        tokens_reused=cache["tokens_reused"],
        tokens_per_second=observe.real(status, "tokens_per_second"),
        counters=observe.counters(status),
        refused=observe.refused(status),
        draining=bool(status.get("draining")),
        batch=observe.batch(status),
        machine=observe.machine(status),
    )


def bar_cells(bar: MemoryBar, width: int) -> list[str]:
    """One colour per cell: each part in proportion to the budget (or, with no budget, to
    5/4 of what is used); a part that holds anything gets at least one cell; the rest of
    the budget is free."""
    width = max(width, 10)
    scale = bar.budget if bar.budget else max(bar.used, 1) * 5 // 4
    cells: list[str] = []
    for key, colour in PARTS:
        size = getattr(bar, key)
        cells += [colour] * max(round(size / scale * width), 1 if size > 0 else 0)
    return cells[:width] + [FREE] * max(width - len(cells), 0)


def header(v: TopView, url: str) -> Text:
    out = Text(no_wrap=True, overflow="ellipsis")
    out.append(v.model or "?", "bold").append(" at ").append(url, "underline")
    out.append(" · policy ").append(v.policy or "?", "bold yellow")
    out.append(f" · {v.tokens_per_second:.1f} tok/s", "bold green")
    if v.batch is not None:
        out.append(f" · batch {v.batch[0]} of {v.batch[1]} answered", "magenta")
    if v.draining:
        out.append(" · shutting down", "bold red")
    return out


def memory_text(v: TopView, width: int) -> Text:
    """The bar, its legend, and the KV and MLX figures under it (lines that fit 80
    columns)."""
    b = v.bar
    out = Text(no_wrap=True, overflow="ellipsis")
    cells = bar_cells(b, width)
    i = 0
    while i < len(cells):  # one span per run of a colour
        j = i
        while j < len(cells) and cells[j] == cells[i]:
            j += 1
        out.append(BAR * (j - i), cells[i])
        i = j
    out.append("\n")
    out.append(f"weights {human_bytes(b.weights)}  ", "blue")
    out.append(f"runtime {human_bytes(b.runtime)}  ", "yellow")
    out.append(f"reserved {human_bytes(b.reserved)} ", "dark_cyan")
    out.append(f"(KV {human_bytes(b.kv)})", "bold cyan")
    out.append("\n")
    out.append(f"prefixes {human_bytes(b.prefixes)}  ", "magenta")
    free = b.free
    if free is None:
        out.append("budget none", "dim")
    elif free < 0:
        out.append(f"over by {human_bytes(-free)}", "bold red")
        out.append(f" of budget {human_bytes(b.budget)}")
    else:
        out.append(f"free {human_bytes(free)}", "dim").append(f" of budget {human_bytes(b.budget)}")
    out.append("\n")
    gap = versus(v.kv_bytes_actual, v.kv_bytes_predicted) if v.kv_bytes_predicted else ""
    out.append("KV actual ", "bold").append(human_bytes(v.kv_bytes_actual), "bold cyan")
    out.append(" · predicted ").append(human_bytes(v.kv_bytes_predicted))
    if gap:
        out.append(f" ({gap})", "green" if gap == "exact" else "yellow")
    out.append("\n")
    out.append(
        f"MLX active {human_bytes(v.active_bytes)} · peak {human_bytes(v.peak_bytes)} · "
        f"cache {human_bytes(v.cache_bytes)}",
        "dim",
    )
    m = v.machine
    if m is not None and m["free_bytes"] is not None:
        out.append("\n")
        free, floor = human_bytes(m["free_bytes"]), human_bytes(m["floor_bytes"])
        line = f"machine free {free} · floor {floor}"
        if m["under_floor"]:
            out.append(line + " · under the floor", "bold red")
        else:
            out.append(line, "dim")
        if m["given_back_bytes"]:
            out.append(f" · given back {human_bytes(m['given_back_bytes'])}", "dim")
    return out


DITTO = "″"  # the batch's bytes, as on the row above
REQUEST_HEAD = (
    f"{'id':>5} {'prompt':>7} {'cached':>7} {'gen':>6} {'KV actual':>10} "
    f"{'predicted':>10} {'reserved':>10}  policy"
)
CACHE_HEAD = f"{'tier':<7} {'entries':>8} {'bytes':>10} {'limit':>10} {'hits':>7} {'hit rate':>9}"
QUEUE_HEAD = f"{'id':>5} {'prompt':>7} {'reserved':>10}  policy"


def requests_text(v: TopView) -> Text:
    out = Text(no_wrap=True, overflow="ellipsis")
    title = f"Running {len(v.running)}"
    if v.prefilling:
        title += f" · prefilling {v.prefilling}"
    out.append(title, "bold").append("\n").append(REQUEST_HEAD, "dim")
    if not v.running:
        out.append("\n").append("(no request running)", "dim")
    for r in v.running:
        out.append("\n")
        out.append(
            f"{r.id:>5} {tokens(r.prompt_tokens):>7} {tokens(r.prompt_tokens_cached):>7} "
            f"{tokens(r.generated):>6} "
        )
        if r.first_in_batch:  # a batch's cache is shared: its bytes are shown once
            out.append(f"{human_bytes(r.kv_bytes):>10} ", "cyan")
            out.append(f"{human_bytes(r.kv_bytes_predicted):>10} ")
        else:
            out.append(f"{DITTO:>10} {DITTO:>10} ", "dim")
        out.append(f"{human_bytes(r.reserved_bytes):>10}  ")
        out.append(r.policy, "yellow")
        if r.batch_rows > 1 and r.first_in_batch:
            out.append(f" · batch of {r.batch_rows}", "dim")
    return out


def queue_text(v: TopView, rows: int = 5) -> Text:
    out = Text(no_wrap=True, overflow="ellipsis")
    out.append(f"Queue {v.waiting} waiting", "bold")
    refused = v.refused
    if refused.get("busy") or refused.get("too_large"):
        out.append(
            f" · refused {refused.get('busy', 0)} busy, {refused.get('too_large', 0)} too large",
            "red",
        )
    if not v.queue:
        return out
    out.append("\n").append(QUEUE_HEAD, "dim")
    for q in v.queue[:rows]:
        out.append("\n")
        out.append(f"{q.id:>5} {tokens(q.prompt_tokens):>7} {human_bytes(q.reserved_bytes):>10}  ")
        out.append(q.policy, "yellow")
    more = v.waiting - min(len(v.queue), rows)
    if more > 0:
        out.append("\n").append(f"      … {more} more", "dim")
    return out


def cache_text(v: TopView) -> Text:
    out = Text(no_wrap=True, overflow="ellipsis")
    out.append("Prefix cache", "bold").append("\n")
    out.append(CACHE_HEAD, "dim")
    for name, t in (("memory", v.memory), ("disk", v.disk)):
        limit = human_bytes(t.limit_bytes) if t.limit_bytes else "-"
        out.append("\n")
        out.append(
            f"{name:<7} {tokens(t.entries):>8} {human_bytes(t.bytes):>10} {limit:>10} "
            f"{tokens(t.hits):>7} {t.hit_ratio:>9.1%}"
        )
    out.append("\n")
    out.append(f"misses {tokens(v.misses)} · tokens reused {tokens(v.tokens_reused)}", "dim")
    if v.disk_dir:
        out.append(f" · disk {v.disk_dir}", "dim")
    return out


def totals_text(v: TopView) -> Text:
    c = v.counters
    out = Text(no_wrap=True, overflow="ellipsis")
    out.append("Since start ", "bold")
    out.append(
        f"{tokens(c.get('requests_finished', 0))} requests finished · "
        f"{tokens(c.get('tokens_generated', 0))} tokens generated · "
        f"{tokens(c.get('steps', 0))} steps"
    )
    if c.get("draft_tokens"):  # greedy answers that checked drafts from their conversation
        out.append(
            f" · {tokens(c.get('draft_tokens_accepted', 0))} of "
            f"{tokens(c['draft_tokens'])} drafts taken"
        )
    out.append("\n")
    out.append("Prompt tokens ", "bold")
    out.append(
        f"{tokens(c.get('prompt_tokens_prefilled', 0))} prefilled, "
        f"{tokens(c.get('prompt_tokens_cached', 0))} from a cache"
    )
    return out
