"""The prefix cache in the engine: batched rows come back as their single caches, a cached
turn answers token for token as an uncached one, entries are bounded in memory and on
disk, and a file that is not a valid entry is never loaded."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxkv.caches.batched import BatchedKVCache, split_row
from mlxkv.caches.full import FullKVCache
from mlxkv.caches.kivi import KiviKVCache
from mlxkv.caches.rotation import Rotation
from mlxkv.caches.streaming import QuantizedStreamingKVCache, StreamingKVCache
from mlxkv.engine.events import Finished
from mlxkv.engine.prefix_cache import DiskTier, PrefixCache
from mlxkv.engine.request import GenerationSettings
from mlxkv.engine.scheduler import Request, Scheduler
from mlxkv.policy import KVPolicy
from tests.kv_rows import prefill_random, random_kv
from tests.memory_watch import worst_beyond_counted

ROT = Rotation(64, False, 100000.0, 1.0)
SINGLES = {
    "full": lambda: FullKVCache(),
    "window": lambda: StreamingKVCache(16, sinks=0),
    "sink+window": lambda: StreamingKVCache(12, sinks=4, rotation=ROT),
    "4-bit full": lambda: QuantizedStreamingKVCache(None, bits=4, group_size=32),
    "4-bit sink+window": lambda: QuantizedStreamingKVCache(
        40, sinks=4, rotation=ROT, bits=4, group_size=32
    ),
    "kivi": lambda: KiviKVCache(None, 0, None, 4, 32, 4),
    "kivi sink+window": lambda: KiviKVCache(64, 4, ROT, 4, 32, 4),
}


def _flat(cache) -> dict:
    state = cache.state
    return dict(enumerate(state)) if isinstance(state, tuple) else dict(tree_flatten(state))


@pytest.mark.parametrize("kind", SINGLES)
def test_a_batched_row_comes_back_as_its_single_cache(kind):
    """Rows of different lengths decode 40 steps in a batch; each row taken back out has
    the same arrays (bit for bit), counters and bytes as the same row decoded alone."""
    make, heads, lens = SINGLES[kind], 2, [5, 70, 300]
    rows = [prefill_random(make(), n, seed=i, heads=heads) for i, n in enumerate(lens)]
    alone = [prefill_random(make(), n, seed=i, heads=heads) for i, n in enumerate(lens)]
    batch = [BatchedKVCache.merge(rows)]
    for step in range(40):
        ks, vs = zip(*[random_kv(1, 1000 + 7 * step + r, heads) for r in range(3)], strict=True)
        batch[0].update_and_fetch(mx.concatenate(ks), mx.concatenate(vs))
        for r, c in enumerate(alone):
            c.update_and_fetch(ks[r], vs[r])
    for r, want in enumerate(alone):
        (got,) = split_row(batch, r)
        assert type(got) is type(want)
        a, b = _flat(got), _flat(want)
        assert a.keys() == b.keys()
        for key, x in a.items():
            if isinstance(x, mx.array):
                assert x.shape == b[key].shape and x.dtype == b[key].dtype, key
                assert mx.array_equal(x, b[key]).item(), key
            else:
                assert x == b[key], key
        assert got.nbytes == want.nbytes


def _render(loaded, messages):
    tok = loaded.tokenizer
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _answer(scheduler, ids, max_tokens=8) -> Finished:
    h = scheduler.submit(Request(ids, GenerationSettings(max_tokens=max_tokens)))
    return next(e for e in h.events() if isinstance(e, Finished))


POLICIES = {
    "full": KVPolicy(),
    "sink+window": KVPolicy(window=48, sinks=4),  # a 70-token prompt has evicted already
    "4-bit": KVPolicy(bits=4),
}


@pytest.mark.model
@pytest.mark.parametrize(
    "name",
    # the full cache's cached turn against an uncached one runs in CI from a file
    # (test_a_closed_schedulers_turn_is_taken_up_from_its_folder_by_the_next)
    [pytest.param(n, marks=pytest.mark.slow) if n == "full" else n for n in POLICIES],
)
def test_a_cached_turn_answers_as_an_uncached_one(default_model, name):
    """Turn 2 reuses turn 1's prompt and answer (every token of it) and its answer is
    token for token the one a scheduler without a prefix cache gives."""
    policy = POLICIES[name]
    cached = Scheduler(default_model, policy, prefix_cache=PrefixCache(1 << 30))
    plain = Scheduler(default_model, policy)
    messages = [
        {"role": "system", "content": "You are terse. " * 10},
        {"role": "user", "content": "Name three fruits."},
    ]
    ids1 = cached.encode(_render(default_model, messages))
    first = _answer(cached, ids1)
    assert first.stats.prompt_tokens_cached == 0
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "More?"}]
    ids2 = cached.encode(_render(default_model, messages))
    second = _answer(cached, ids2)
    reference = _answer(plain, ids2)
    held = len(ids1) + first.stats.generation_tokens
    assert ids2[:held][: len(ids1)] == ids1
    assert second.stats.prompt_tokens_cached == held
    assert cached.prompt_tokens_prefilled == len(ids1) + len(ids2) - held
    assert second.text == reference.text


@pytest.mark.model
def test_memory_tier_spills_to_a_bounded_disk_tier_and_skips_foreign_files(default_model, tmp_path):
    """An entry past the memory limit goes to disk; the disk tier keeps its size by
    removing its own oldest files; a corrupted file and one made for another model are
    skipped with a log line, never loaded, never removed."""
    from mlxkv.engine.reuse import cache_identity, save_held

    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    identity = cache_identity(default_model)
    policy = KVPolicy(bits=4)
    log: list[str] = []
    scheduler = Scheduler(default_model, policy, prefix_cache=PrefixCache(1 << 30))
    ids = scheduler.encode(_render(default_model, [{"role": "user", "content": "Hello there"}]))
    _answer(scheduler, ids, max_tokens=2)
    entry = scheduler.prefix.entries[-1]
    other = tmp_path / "other.safetensors"
    meta = dict(identity, model_id="0" * 64, policy=policy.to_dict())
    save_held(other, entry.caches, entry.tokens, entry.checkpoint, meta)
    planted = {p.name: p.read_bytes() for p in (junk, other)}
    spilled = tmp_path / "spilled.tmp"  # the file of an entry as it spills: without its copy
    save_held(spilled, entry.caches, entry.tokens, None, meta)
    file = spilled.stat().st_size
    spilled.unlink()

    one = sum(c.nbytes for c in entry.caches)  # an entry without its turn-boundary copy
    disk = DiskTier(tmp_path, 2 * file + file // 2, identity, log.append)
    assert disk.files == {}
    assert any("skipped junk.safetensors" in line for line in log)
    assert any("skipped other.safetensors: made for another model" in line for line in log)
    cache = PrefixCache(one, default_model.model, disk, log.append)
    for i in range(4):  # four conversations; memory holds one entry, disk about two
        text = f"Conversation number {i}: say hi"
        s = Scheduler(default_model, policy, prefix_cache=cache)
        _answer(s, s.encode(_render(default_model, [{"role": "user", "content": text}])), 2)
    assert len(cache.entries) == 1 and cache.nbytes <= one
    ours = sorted(p for p in tmp_path.iterdir() if p.name.startswith("prefix-"))
    assert 1 <= len(ours) <= 2 and len(ours) == len(disk.files)
    assert sum(p.stat().st_size for p in ours) <= disk.limit
    assert {p.name: p.read_bytes() for p in (junk, other)} == planted

    # the newest conversation on disk comes back from it, checked, and is reused
    newest = max(disk.files.values(), key=lambda f: f.used)
    s = Scheduler(default_model, policy, prefix_cache=PrefixCache(one, default_model.model, disk))
    s.prefix.entries.clear()
    follow = newest.tokens + s.encode("<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n")
    done = _answer(s, follow, max_tokens=2)
    assert done.stats.prompt_tokens_cached == len(newest.tokens)
    assert disk.hits == 1


@pytest.mark.model
def test_a_closed_schedulers_turn_is_taken_up_from_its_folder_by_the_next(default_model, tmp_path):
    """Closing writes the kept prefixes to the folder (a stopping server); a new scheduler
    over that folder (the restarted server) answers the next turn from the file, every token
    of the first turn held, as a scheduler without a prefix cache answers it. (A real
    server's restart: tests/test_serve_prefix.py, slow.)"""
    from mlxkv.engine.reuse import cache_identity

    identity, log = cache_identity(default_model), []

    def opened() -> tuple[Scheduler, DiskTier]:
        disk = DiskTier(tmp_path, 1 << 30, identity, log.append)
        cache = PrefixCache(1 << 30, default_model.model, disk)
        return Scheduler(default_model, prefix_cache=cache), disk

    before, _ = opened()
    messages = [{"role": "user", "content": "Say hello to the restart test."}]
    ids1 = before.encode(_render(default_model, messages))
    first = _answer(before, ids1)
    assert not list(tmp_path.glob("prefix-*"))  # in memory until the close
    before.close()
    assert len(list(tmp_path.glob("prefix-*.safetensors"))) == 1
    after, disk = opened()
    assert len(disk.files) == 1
    messages += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Thanks."},
    ]
    ids2 = after.encode(_render(default_model, messages))
    second = _answer(after, ids2)
    assert second.stats.prompt_tokens_cached == len(ids1) + first.stats.generation_tokens
    assert (disk.hits, after.prefix.hits) == (1, 1)
    assert second.text == _answer(Scheduler(default_model), ids2).text
    assert log == []  # no file skipped


def test_a_write_left_by_a_killed_server_is_removed_at_start(tmp_path):
    """A server killed mid-write left ``.prefix-*.safetensors.*.tmp`` (35 MB in the case
    found), which no limit counted and no run removed. A write still going (touched
    recently), and files that are not this cache's, stay."""
    import os
    import time

    from mlxkv.engine.prefix_cache import ABANDONED_AFTER

    old = tmp_path / f".prefix-{'0123abcd' * 4}.safetensors.x1y2z3_4.tmp"
    going = tmp_path / f".prefix-{'4567ef01' * 4}.safetensors.a1b2c3d4.tmp"
    mine = [tmp_path / ".prefix-notes.tmp", tmp_path / "prefix-draft.safetensors.tmp"]
    mine.append(tmp_path / ".prefix-notes.safetensors.old.tmp")  # a user's: it was removed
    for p in (old, going, *mine):
        p.write_bytes(b"x" * 100)
    then = time.time() - ABANDONED_AFTER - 5
    for p in (old, *mine):
        os.utime(p, (then, then))
    log: list[str] = []
    DiskTier(tmp_path, 1 << 20, {"model_id": "m", "dtype": "float32"}, log.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (going, *mine))
    assert log == [f"prefix cache: removed {old.name} (an unfinished write of a stopped server)"]


@pytest.mark.model
def test_a_damaged_file_gives_way_to_the_next_that_holds_the_prompt(default_model, tmp_path):
    """Two files with the same tokens, the damaged one ranked first: it was skipped and the
    request missed the cache, though the good file held its prompt."""
    from mlxkv.engine.reuse import cache_identity, save_held

    identity = cache_identity(default_model)
    policy = KVPolicy()
    scheduler = Scheduler(default_model, policy, prefix_cache=PrefixCache(1 << 30))
    ids = scheduler.encode(_render(default_model, [{"role": "user", "content": "Hello there"}]))
    _answer(scheduler, ids, max_tokens=2)
    entry = scheduler.prefix.entries[-1]
    meta = dict(identity, policy=policy.to_dict())
    damaged, good = tmp_path / "a-damaged.safetensors", tmp_path / "b-good.safetensors"
    for path in (damaged, good):
        save_held(path, entry.caches, entry.tokens, entry.checkpoint, meta)
    data = bytearray(damaged.read_bytes())
    data[-8:-4] = b"\xff\xff\xff\x7f"  # a NaN inside the tensors: only the digest sees it
    damaged.write_bytes(bytes(data))
    log: list[str] = []
    disk = DiskTier(tmp_path, 1 << 30, identity, log.append)
    assert list(disk.files) == [damaged, good]  # equal prefixes: the first one ranks first
    cache = PrefixCache(1 << 30, default_model.model, disk, log.append)
    held, caches = cache.take(policy, entry.tokens + ids[-1:])
    assert held == len(entry.tokens) and caches is not None
    assert [line.split(":")[1].strip() for line in log] == ["skipped a-damaged.safetensors"]
    assert damaged.exists()  # skipped, never removed


def test_a_read_only_folder_is_read_and_said_once(tmp_path):
    """A read-only --prefix-cache-dir logged a failed write twice per request, forever."""
    import shutil
    import subprocess
    import sys

    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) drops root's permission override")
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o555)
    script = (
        "import sys\n"
        "from mlxkv.engine.prefix_cache import DiskTier\n"
        "d = DiskTier(sys.argv[1], 1 << 20, {'model_id': 'm'}, print)\n"
        "d.put(None)\n"  # not written: put returns before it reads the entry
        "print(d.writable)\n"
    )
    try:
        run = subprocess.run(
            [setpriv, "--bounding-set", "-dac_override,-dac_read_search,-fowner", sys.executable,
             "-c", script, str(folder)], capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        folder.chmod(0o755)
    assert run.returncode == 0, run.stderr
    assert run.stdout == (
        f"prefix cache: {folder} is read-only: its files are read, none is written\nFalse\n"
    )


def test_kept_prefixes_give_way_to_the_memory_budget(default_model):
    """A finished window request leaves its caches and its turn-boundary copy, about twice
    the reservation its end frees: the prefix cache lets go of what does not fit, so
    weights + runtime + kept prefixes stay within the budget with nothing running (the copy
    goes first: the caches still serve every prompt that extends the answer)."""
    from mlxkv.engine.admission import MemoryBudget

    policy = KVPolicy(window=64, sinks=4)
    ids = Scheduler(default_model).encode("Tell me about the sea. " * 4)
    settings = GenerationSettings(max_tokens=8)
    probe = MemoryBudget(default_model, None, 4, 512)
    budget = probe.base() + probe.reservation(policy, len(ids) + 8) + (1 << 20)
    memory = MemoryBudget(default_model, budget, 4, 512)
    cache = PrefixCache(1 << 30)
    s = Scheduler(default_model, policy, prefix_cache=cache, memory=memory)
    assert isinstance(list(s.submit(Request(ids, settings)).events())[-1], Finished)
    assert 0 < cache.nbytes and memory.base() + cache.nbytes <= budget, cache.nbytes


@pytest.mark.model
@pytest.mark.parametrize(
    "policy",
    # CI keeps the rows of the policy with the most buffers (sinks, window, packed bits)
    [pytest.param(KVPolicy(), marks=pytest.mark.slow), KVPolicy(window=100, sinks=4, bits=4)],
)
def test_rows_kept_from_a_batch_hold_their_own_bytes_only(default_model, policy):
    """Four requests decode as one batch and each row is kept as it ends; with room for
    one entry, what MLX holds afterwards is that entry's bytes (a row kept as a view of
    the batch's buffers held all four rows' worth)."""
    import gc

    ids = [(7 * i + 100) % 40000 for i in range(300)]
    gc.collect()
    before = mx.get_active_memory()
    probe = Scheduler(default_model, policy)
    row = _answer(probe, ids, max_tokens=4).stats.kv_bytes_actual
    cache = PrefixCache(row + (1 << 20))  # room for one kept row
    s = Scheduler(default_model, policy, prefix_cache=cache)
    handles = [
        s.submit(Request(ids + [i + 200], GenerationSettings(max_tokens=6))) for i in range(4)
    ]
    for h in handles:
        assert isinstance(list(h.events())[-1], Finished)
    del handles, probe
    gc.collect()
    assert len(cache.entries) == 1
    held = mx.get_active_memory() - before
    assert held <= cache.nbytes + (1 << 20), (held, cache.nbytes)


@pytest.mark.model
def test_an_edited_turn_reuses_what_precedes_the_edit(default_model):
    """A chat client re-sends a conversation with its third question edited, under a window
    that has evicted since: the kept turn-boundary copy, taken before the window evicted,
    trims back to the edit, and the answer is the one an uncached request gets."""
    policy = KVPolicy(window=64, sinks=4)
    s = Scheduler(default_model, policy, prefix_cache=PrefixCache(1 << 30))
    messages = [{"role": "system", "content": "You are terse."}]
    for q in ("Name a fruit.", "Name a colour.", "Name a city.", "Name a dog.", "Name a cat."):
        messages.append({"role": "user", "content": q})
        answer = _answer(s, s.encode(_render(default_model, messages)))
        messages.append({"role": "assistant", "content": answer.text})
    edited = s.encode(
        _render(default_model, [*messages[:5], {"role": "user", "content": "Name a river."}])
    )
    first = _answer(s, edited)
    assert first.stats.prompt_tokens_cached > 0
    assert first.text == _answer(Scheduler(default_model, policy), edited).text


@pytest.mark.model
def test_a_kept_sink_request_holds_its_counted_bytes(default_model):
    """What MLX holds once a sink request has ended and been kept is the entry's bytes
    (its caches and turn-boundary copy), up to the allocator's rounding: the sink rotations
    decoding computed ahead (32 steps of them) are let go."""
    import gc

    from mlx.utils import tree_flatten

    policy = KVPolicy(window=64, sinks=4)
    ids = Scheduler(default_model).encode("Tell me a long story about the sea. " * 6)
    _answer(Scheduler(default_model, policy), ids)  # MLX's own first-call buffers
    gc.collect()
    before = mx.get_active_memory()
    cache = PrefixCache(1 << 30)
    _answer(Scheduler(default_model, policy, prefix_cache=cache), ids, max_tokens=40)
    gc.collect()
    (e,) = cache.entries
    states = [c.state for c in e.caches] + [e.checkpoint.states]
    arrays = [x for _, x in tree_flatten(states) if isinstance(x, mx.array)]
    extra = mx.get_active_memory() - before - cache.nbytes
    # the allocator rounds each buffer up; the copy shares the sink keys with the caches
    assert abs(extra) < 4096 * len(arrays), extra


@pytest.mark.model
@pytest.mark.parametrize(
    "policy",
    # 8 s each alone, 10 s beside the other CI worker: CI runs the many-sinks case, whose
    # rotated block is largest
    [
        pytest.param(KVPolicy(window=64), marks=pytest.mark.slow),
        pytest.param(KVPolicy(window=64, sinks=4), marks=pytest.mark.slow),
        KVPolicy(window=80, sinks=48),
    ],
    ids=lambda p: p.describe(),
)
def test_a_repeated_window_request_counts_the_copy_it_holds(default_model, policy):
    """The same window request twice: the second starts from the first's kept caches and
    takes its own turn-boundary copy, which no kept prefix holds; while it decodes, what
    MLX holds beyond the first's kept entry is within its reservation (its sinks rotated
    ahead included) and that copy."""
    import gc

    from mlxkv.engine.admission import MemoryBudget

    ids = Scheduler(default_model).encode("Tell me a long story about the sea. " * 6)
    _answer(Scheduler(default_model, policy), ids)  # MLX's own first-call buffers
    gc.collect()
    before = mx.get_active_memory()
    cache = PrefixCache(1 << 30)
    memory = MemoryBudget(default_model, 1 << 40, 4, 512)  # counts, never refuses
    s = Scheduler(default_model, policy, prefix_cache=cache, memory=memory)
    _answer(s, ids, max_tokens=40)
    h = s.submit(Request(ids, GenerationSettings(max_tokens=40)))
    worst = worst_beyond_counted(
        s, h, before, lambda m: m["reserved_bytes"] + m["prefix_cache_bytes"]
    )
    assert worst < 1 << 20, worst  # the allocator's rounding, a step's logits


@pytest.mark.model
def test_a_long_conversation_keeps_its_last_turns_only(default_model):
    """An agent's session under a window or quantized cache (which cannot trim back) kept
    one entry per turn: 120 turns filled 6.8 GB of the memory tier. It keeps the newest
    turn and the EARLIER_TURNS before it; the next turn still starts from the newest."""
    from mlxkv.engine.prefix_cache import EARLIER_TURNS

    cache = PrefixCache(1 << 30)
    s = Scheduler(default_model, KVPolicy(window=64, sinks=4), prefix_cache=cache)
    messages = [{"role": "system", "content": "You are terse."}]
    counts, before = [], 0
    for q in ("Name a fruit.", "Name a colour.", "Name a city.", "Name a dog.", "Name a cat.",
              "Name a tree.", "Name a river.", "Name a bird."):  # fmt: skip
        messages.append({"role": "user", "content": q})
        ids = s.encode(_render(default_model, messages))
        answer = _answer(s, ids)
        assert answer.stats.prompt_tokens_cached >= before  # the turn before, at least
        before = len(ids)
        messages.append({"role": "assistant", "content": answer.text})
        counts.append(len(cache.entries))
    # it grew by one a turn once the window had evicted: [1, 1, 1, 2, 3, 4, 5, 6]
    assert max(counts) == counts[-1] == 1 + EARLIER_TURNS, counts


def test_a_file_whose_check_fails_without_a_message_is_skipped(tmp_path, monkeypatch):
    """A check that fails with no text (MemoryError()) is logged by its type; the scan took
    the first line of an empty message and stopped with an IndexError."""
    import mlxkv.caches.persist as persist

    def fails(path):
        raise MemoryError()

    monkeypatch.setattr(persist, "read_metadata", fails)
    (tmp_path / "a.safetensors").write_bytes(b"x" * 16)
    log: list[str] = []
    disk = DiskTier(tmp_path, 1 << 20, {}, log.append)
    assert disk.files == {}
    assert log == ["prefix cache: skipped a.safetensors: MemoryError"]
    assert (tmp_path / "a.safetensors").read_bytes() == b"x" * 16


@pytest.mark.model
def test_a_few_shared_template_tokens_are_not_a_hit(default_model):
    """Two conversations that share only their template's first tokens: the second is a
    miss (nothing copied, no hit counted); sharing MIN_REUSE tokens, it is a hit."""
    from mlxkv.engine.prefix_cache import MIN_REUSE

    cache = PrefixCache(1 << 30)
    s = Scheduler(default_model, prefix_cache=cache)
    ids = s.encode("The sea was calm that night, and the boats came home slowly. " * 3)
    _answer(s, ids, max_tokens=2)
    few = ids[: MIN_REUSE - 1] + [t + 1 for t in ids[MIN_REUSE - 1 :]]
    assert cache.take(KVPolicy(), few) == (0, None)
    assert (cache.hits, cache.misses) == (0, 2)  # the first answer's lookup missed too
    held, caches = cache.take(KVPolicy(), ids[:MIN_REUSE] + [t + 1 for t in ids[MIN_REUSE:]])
    assert held == MIN_REUSE and caches is not None and cache.hits == 1
