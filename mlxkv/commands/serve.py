"""``mlxkv serve``: an OpenAI-, Anthropic- and Ollama-compatible HTTP server for one model (see
mlxkv/server/)."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from mlxkv.commands.common import (
    add_cache_flags,
    add_generation_flags,
    add_model_flags,
    add_shard_flag,
    chat_template_from_args,
    model_id,
    policy_from_args,
    settings_from_args,
    status,
)
from mlxkv.errors import UserError
from mlxkv.memory.budget import human_bytes
from mlxkv.models.pooling import POOLINGS

HELP = (
    "serve one model over OpenAI's HTTP API (chat and text completions, responses, "
    "embeddings), Anthropic's (messages), Ollama's (chat, generate, embed) and llama.cpp's "
    "/infill"
)
KEY_ENV = "MLXKV_API_KEY"


def add_arguments(p) -> None:
    p.epilog = (
        "Under mlx.launch (mlx.launch ... -- $(which mlxkv) serve ...) the model is split over "
        "the ranks (--shard): rank 0 listens and answers, the others compute in step with it "
        "(docs/distributed.md)."
    )
    p.add_argument(
        "model_arg",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model to serve (as --model; default: the registry default)",
    )
    add_model_flags(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 = any free one)")
    g.add_argument(
        "--max-batch",
        type=int,
        default=16,
        metavar="N",
        help="answers decoded together under one KV policy (default 16)",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=256,
        metavar="N",
        help="answers that may wait for a row; past it a request gets 429 (default 256)",
    )
    g.add_argument(
        "--batch-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests of a batch (/v1/batches) in flight at once (default: --max-batch "
        "minus one, so a client's request never waits for a batch's)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' (default: ${KEY_ENV}); needed to listen "
        "on an address other than loopback",
    )
    g.add_argument(
        "--max-body",
        type=int,
        default=8 * 2**20,
        metavar="BYTES",
        help="largest request body taken, in bytes (default 8 MiB); larger gets 413",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="on SIGTERM/Ctrl+C, seconds the answers in flight get to finish before they are "
        "cut with an error (default 10); a second signal cuts them at once",
    )
    g.add_argument(
        "--embedding-pooling",
        choices=POOLINGS,
        default=None,
        help="an embedding is the final hidden state at the input's last token or their "
        "mean over the input (default: as the model's sentence-transformers files say, "
        "else last, which decoder embedding models such as Qwen3-Embedding are read at)",
    )
    g.add_argument("--no-access-log", action="store_true", help="no line per HTTP request")
    g.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="one more name a request's model may give, beside the model's own (repeat the "
        "flag for more); a name with *, ? or [ is a pattern ('claude-*', '*' for any), for "
        "clients that send a name of their own; the first plain name is the one /v1/models "
        "lists and answers carry",
    )
    g.add_argument(
        "--conversation-dir",
        metavar="DIR",
        help="folder where conversations (/v1/conversations) are kept across restarts "
        "(default: MLXKV_HOME/conversations); 'none' keeps them in memory only",
    )
    g.add_argument(
        "--responses-dir",
        metavar="DIR",
        help="folder where stored responses (/v1/responses with store, previous_response_id) "
        "are kept across restarts (default: MLXKV_HOME/responses); 'none' keeps them in "
        "memory only",
    )
    g.add_argument(
        "--files-dir",
        metavar="DIR",
        help="folder of the files uploaded to /v1/files and of the batches run on them "
        "(/v1/batches), kept across restarts until deleted or expired (an upload after 30 "
        "days unless it says; default: MLXKV_HOME/files); 'none' turns both off",
    )
    m = p.add_argument_group("memory and the prefix cache")
    m.add_argument(
        "--memory",
        metavar="SIZE",
        help="memory budget for weights + runtime + KV reservations + kept prefixes, e.g. "
        "16GB (default: what the machine has, as mlxkv plan reads it); a request starts only "
        "when its KV reservation fits",
    )
    m.add_argument(
        "--memory-floor",
        metavar="SIZE",
        help="memory the machine keeps free for its other programs (default: a tenth of its "
        "memory, 1 to 8 GiB; 0 turns it off): below it the server gives back MLX's freed "
        "buffers and kept prefixes (to disk), and starts a new request beside running ones "
        "only where its KV fits above it",
    )
    m.add_argument(
        "--prefix-cache-bytes",
        metavar="SIZE",
        help="memory for finished requests' caches that later requests reuse (default: half "
        "of what the budget leaves after the weights and runtime; 0 turns the cache off)",
    )
    m.add_argument(
        "--prefix-cache-dir",
        metavar="DIR",
        help="folder for prefix-cache entries evicted from memory (default: "
        "MLXKV_HOME/prefix-cache/<model digest>); 'none' keeps no files",
    )
    m.add_argument(
        "--prefix-cache-disk-bytes",
        metavar="SIZE",
        default="8GiB",
        help="most bytes of files in --prefix-cache-dir (default 8GiB)",
    )
    add_cache_flags(p)
    add_shard_flag(p)
    add_generation_flags(p, max_tokens=None)


def _check(args) -> str | None:
    """Refuse bad server flags before anything loads; returns the API key (or None)."""
    from mlxkv.server.local import is_loopback

    if args.model_arg is not None and args.model is not None:
        raise UserError("give the model once: as MODEL or as --model")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_batch < 1:
        raise UserError(f"--max-batch must be at least 1, got {args.max_batch}")
    if args.batch_requests is not None and args.batch_requests < 1:
        raise UserError(f"--batch-requests must be at least 1, got {args.batch_requests}")
    if args.max_queue < 0:
        raise UserError(f"--max-queue must be 0 or more, got {args.max_queue}")
    if args.max_body < 1024:
        raise UserError(f"--max-body must be at least 1024 bytes, got {args.max_body}")
    if not args.shutdown_timeout >= 0:
        raise UserError(f"--shutdown-timeout must be 0 or more, got {args.shutdown_timeout}")
    for name in args.served_model_name:
        if not name or len(name) > 256 or not name.isprintable() or name != name.strip():
            raise UserError(
                f"--served-model-name {name!r}: a name is 1 to 256 printable characters, "
                "without spaces at either end"
            )
    key = args.api_key if args.api_key is not None else os.environ.get(KEY_ENV) or None
    if key is not None and (not key.strip() or any(c.isspace() for c in key)):
        raise UserError("the API key must be non-empty and hold no spaces")
    if key is None and not is_loopback(args.host):
        raise UserError(
            f"--host {args.host} would let other machines in without a key; "
            f"set --api-key KEY (or {KEY_ENV}) or listen on 127.0.0.1"
        )
    return key


def _size(flag: str, text: str) -> int:
    from mlxkv.memory.config import BadInput
    from mlxkv.memory.system import parse_size

    if text.strip() == "0":
        return 0
    try:
        return parse_size(text)
    except BadInput:
        raise UserError(f"{flag} must be a size like 2GB, 512MiB or 0, got '{text}'") from None


def _check_memory_flags(args) -> None:
    """Refuse bad memory flags before anything loads."""
    from mlxkv.memory.config import BadInput
    from mlxkv.memory.system import parse_size

    if args.memory is not None:
        try:
            parse_size(args.memory)
        except BadInput as e:
            raise UserError(str(e)) from None
    if args.prefix_cache_bytes is not None:
        _size("--prefix-cache-bytes", args.prefix_cache_bytes)
    if args.memory_floor is not None:
        _size("--memory-floor", args.memory_floor)
    _size("--prefix-cache-disk-bytes", args.prefix_cache_disk_bytes)
    for flag, d in (
        ("--prefix-cache-dir", args.prefix_cache_dir),
        ("--conversation-dir", args.conversation_dir),
        ("--files-dir", args.files_dir),
        ("--responses-dir", args.responses_dir),
    ):
        if d is not None and d != "none" and Path(d).exists() and not Path(d).is_dir():
            raise UserError(f"{flag} {d} is not a folder; name a folder or 'none'")


def _memory_and_prefixes(args, loaded, policy, cluster=None, lockstep=None):
    """The memory budget and the prefix cache (memory tier, and the disk tier's folder).
    Across ranks (``cluster``) every rank takes the same decisions: the budget is the
    smallest host's, the shares counted are the largest rank's (kept prefixes too: the
    ``lockstep``'s largest), and the prefix cache keeps no files (each host's folder
    differs)."""
    from mlxkv.engine.admission import MemoryBudget
    from mlxkv.engine.prefix_cache import DiskTier, PrefixCache
    from mlxkv.engine.reuse import cache_identity
    from mlxkv.memory.dtypes import backend
    from mlxkv.memory.system import system_memory
    from mlxkv.paths import home

    budget = system_memory(args.memory, backend()).available
    layout = weights = None
    if cluster is not None:
        budget = _smallest_budget(cluster, budget)
        layout, weights = _largest_share(cluster, loaded, policy)
    drafts = args.draft_tokens if cluster is None else 0  # (ranks take none: the scheduler)
    memory = MemoryBudget(loaded, budget, args.max_batch, 512, layout, weights, drafts)
    if cluster is not None:
        _check_same_figures(cluster, memory, policy)
    _check_one_answer_fits(args, memory, policy)
    free = max(budget - memory.base(), 0)
    limit = free // 2
    if args.prefix_cache_bytes is not None:
        limit = _size("--prefix-cache-bytes", args.prefix_cache_bytes)
    if limit == 0:
        return memory, None
    disk = None
    disk_limit = _size("--prefix-cache-disk-bytes", args.prefix_cache_disk_bytes)
    if args.prefix_cache_dir != "none" and disk_limit > 0 and cluster is None:
        identity = cache_identity(loaded)
        folder = args.prefix_cache_dir
        if folder is None:
            folder = home() / "prefix-cache" / identity["model_id"][:16]
        try:
            disk = DiskTier(Path(folder), disk_limit, identity, status)
        except OSError as e:
            raise UserError(f"--prefix-cache-dir {folder}: {e.strerror or e}") from None
    status(
        f"memory budget {budget / 2**30:.2f} GiB; prefix cache {limit / 2**30:.2f} GiB in memory"
        + (f", files in {disk.folder} ({len(disk.files)} kept)" if disk else "")
    )
    count = None if lockstep is None else lockstep.largest
    return memory, PrefixCache(limit, loaded.model, disk, status, count)


def _conversations(args):
    """The conversation store, with its files in ``--conversation-dir`` read back."""
    from mlxkv.server.conversation_files import ConversationFiles
    from mlxkv.server.conversation_store import ConversationStore

    flag, given = "--conversation-dir", args.conversation_dir
    return _kept(flag, given, "conversations", ConversationStore, ConversationFiles)


def _responses(args):
    """The response store, with its files in ``--responses-dir`` read back."""
    from mlxkv.server.response_files import ResponseFiles
    from mlxkv.server.response_store import ResponseStore

    flag, given = "--responses-dir", args.responses_dir
    return _kept(flag, given, "responses", ResponseStore, ResponseFiles, "stored responses")


def _kept(flag: str, given: str | None, name: str, store, journal, what: str = ""):
    """A store whose changes ``journal`` writes to the folder ``flag`` names, read back
    (memory only where that is 'none' or another server owns the folder)."""
    what = what or name
    busy = f"this server keeps its {what} in memory only (give it a {flag} of its own to keep "
    files, folder = _owned(flag, name, journal, busy + "them)", given)
    if files is None:
        return store()
    kept = store(journal=files)
    kept.load(files.load(kept.limit))
    status(f"{name}: {len(kept)} kept in {folder}")
    return kept


def _files(args):
    """The folder of uploaded files and batches (None where that is 'none' or another
    server owns it)."""
    from mlxkv.server.file_store import FileStore

    busy = "this server runs no batches (give it a --files-dir of its own to run them)"
    files, folder = _owned("--files-dir", "files", FileStore, busy, args.files_dir)
    if files is not None:
        status(f"files: {len(files.all())} kept in {folder}")
    return files


def _owned(flag: str, name: str, make, busy: str, given: str | None):
    """``make(folder, log)`` on the folder ``flag`` names (``given``; by default ``name``
    under MLXKV_HOME), and the folder; None where it is 'none' or another server owns it
    (``busy`` says what that costs)."""
    from mlxkv.files import FolderBusy
    from mlxkv.paths import home

    if given == "none":
        return None, None
    folder = Path(given or home() / name)
    try:
        return make(folder, status), folder
    except FolderBusy as e:
        status(f"{name}: {e}: {busy}")
        return None, folder
    except OSError as e:
        raise UserError(f"{flag} {folder}: {e.strerror or e}") from None


def _smallest_budget(cluster, budget: int) -> int:
    from mlxkv.engine.distributed import gather_ints

    return min(row[0] for row in gather_ints(cluster, [budget]))


def _largest_share(cluster, loaded, policy):
    """The KV layout and weight bytes of the rank that holds the most: every rank admits by
    them (ranks split by layers hold unequal shares)."""
    from mlxkv.engine.distributed import gather_ints
    from mlxkv.memory import layout_for
    from mlxkv.memory.hosts import host_layout
    from mlxkv.memory.predictor import KVPredictor

    full = layout_for(loaded.config)
    shares = [host_layout(full, cluster.size, r, loaded.shard) for r in range(cluster.size)]

    def kv(layout) -> int:
        return KVPredictor(layout, policy, 1, loaded.dtype).prefill(4096, 512).peak_allocated

    weights = max(row[0] for row in gather_ints(cluster, [loaded.weights_bytes]))
    return max(shares, key=kv), weights


def _check_same_figures(cluster, memory, policy) -> None:
    """Every rank's admission must decide as rank 0's: the same budget, weights, runtime
    and KV reservations. By construction they are; a rank that differs is refused here
    rather than found apart at its first request."""
    from mlxkv.engine.distributed import gather_ints

    rows = gather_ints(cluster, [memory.budget, memory.base(), memory.reservation(policy, 4096)])
    other = next((r for r, row in enumerate(rows) if row != rows[0]), None)
    if other is not None:
        raise UserError(
            f"rank {other} counts other memory figures than rank 0 (budget, weights and "
            f"runtime, a reservation: {rows[other]} against {rows[0]}); run the same mlxkv "
            "on every rank"
        )


def _split_mode(args, model: str | None, ranks: int) -> str:
    """How serve splits the model over ``ranks`` (--shard; auto: by heads where they
    divide), refused in one line before anything loads."""
    from mlxkv.memory.config import BadInput
    from mlxkv.memory.hosts import choose_split
    from mlxkv.memory.source import from_path
    from mlxkv.models.resolve import resolve

    config = from_path(resolve(model, on_status=status).path).config
    try:
        return choose_split(config, args.shard, ranks)
    except BadInput as e:
        raise UserError(str(e)) from None


def _check_one_answer_fits(args, memory, policy) -> None:
    """Refuse a budget in which a request that leaves max_tokens out never fits, even with
    a one-token prompt (its answer reserves --max-tokens, or the first RESERVE_STEP tokens
    of an open-ended answer): every such request would be refused, blaming a max_tokens its
    client never sent."""
    from mlxkv.engine.request import RESERVE_STEP
    from mlxkv.memory.budget import gib

    answer = args.max_tokens or RESERVE_STEP
    need = memory.reservation(policy, 1 + answer)
    room = memory.budget - memory.base()
    if need <= room:
        return
    given = f"--memory {args.memory}" if args.memory else "this machine's memory budget"

    def mib(n: int) -> str:  # KV sizes here are far below a GiB
        return f"{n / 2**20:,.0f} MiB"

    what = (
        f"one answer of --max-tokens {answer} needs"
        if args.max_tokens
        else f"the first {answer} tokens of an answer need"
    )
    raise UserError(
        f"{given} leaves {mib(max(room, 0))} for the KV cache after the weights "
        f"({gib(memory.fixed.weights)}) and runtime ({gib(memory.fixed.runtime)}), less than "
        f"{what} ({mib(need)}, {policy.describe()}); raise --memory to at least "
        f"{math.ceil((memory.base() + need) / 2**28) / 4:g}GiB"
        + (", or lower --max-tokens" if args.max_tokens else "")
    )


def _names(loaded, given: list[str]) -> tuple[str, set[str], tuple[str, ...]]:
    """The model id /v1/models lists, every name a request may use for it, and the patterns
    of ``--served-model-name`` (whose first plain name is the id)."""
    from mlxkv.models.registry import lookup

    name = loaded.name
    served = model_id(name)
    names = {served}
    entry = lookup(name)
    if entry is not None:
        names |= {entry.alias, entry.hf_repo}
    patterns = tuple(n for n in given if any(c in n for c in "*?["))
    plain = [n for n in given if n not in patterns]
    return (plain[0] if plain else served), names | set(plain), patterns


def _pooling(args, loaded) -> tuple[str, bool]:
    """How embeddings pool (--embedding-pooling, else as the model's sentence-transformers
    files say, else at the last token), and whether the model is an embedding model (has
    those files)."""
    from mlxkv.models.pooling import trained_pooling

    trained, note = trained_pooling(Path(loaded.path))
    if note is not None:
        status(f"{note}; embeddings pool as --embedding-pooling says (default last)")
    if args.embedding_pooling is None and trained is not None:
        where = "the last token's state" if trained == "last" else "the mean of the states"
        status(f"embeddings are {where}, as the model's sentence-transformers files say")
    return args.embedding_pooling or trained or "last", trained is not None


def _facts(loaded) -> dict:
    """What listings say of the served model (Ollama's /api/tags and /api/show): its family,
    size, parameters, quantization, digest and shape."""
    from mlxkv.memory.weights import from_local
    from mlxkv.models.identity import model_identity

    config = loaded.config
    weights = from_local(loaded.path, config, loaded.dtype, not loaded.packed)
    params = weights.params if weights is not None else 0
    quant = config.get("quantization") or config.get("quantization_config") or {}
    bits = quant.get("bits") if isinstance(quant, dict) else None
    size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M" if params else ""
    return {
        "family": config.get("model_type", ""),
        "parameter_count": params,
        "parameter_size": size,
        # as held: a checkpoint's packed layers are dequantized unless the GPU rule keeps them
        "quantization_level": f"Q{bits}" if bits and loaded.packed else _short(loaded.dtype),
        "size": loaded.weights_bytes,
        "digest": model_identity(loaded.path),
        "context_length": loaded.context_length,
        "embedding_length": config.get("hidden_size"),
        "block_count": config.get("num_hidden_layers"),
    }


def _short(dtype: str) -> str:
    """A dtype as model listings write it: F32, F16, BF16."""
    return {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(dtype, dtype.upper())


def _engine(args, model, policy, cluster, shard: str = "auto", template=None, floor=None):
    """The loaded model (this rank's share, under mlx.launch) and its scheduler (keeping
    the machine's free memory above ``floor``, a MemoryFloor)."""
    from mlxkv.engine.loading import open_model
    from mlxkv.engine.lockstep import Lockstep
    from mlxkv.engine.scheduler import Scheduler

    loaded = open_model(
        model,
        args.dtype,
        policy,
        args.force,
        on_status=status,
        cluster=cluster,
        shard=shard,
        chat_template=template,
    )
    lockstep = None if cluster is None else Lockstep(cluster)
    memory, prefix = _memory_and_prefixes(args, loaded, policy, cluster, lockstep)
    scheduler = Scheduler(
        loaded,
        policy=policy,
        max_batch=args.max_batch,
        prefix_cache=prefix,
        memory=memory,
        lockstep=lockstep,
        draft_tokens=args.draft_tokens,
        floor=floor,
    )
    return loaded, scheduler


def _floor(args):
    """The machine's free memory kept above ``--memory-floor`` (None: 0, or a machine
    whose free memory cannot be read); a floor of all its memory is refused."""
    from mlxkv.engine.pressure import MemoryFloor, default_floor
    from mlxkv.memory.dtypes import backend
    from mlxkv.memory.system import SystemGauge

    gauge = SystemGauge(backend())
    now = gauge.free()
    if args.memory_floor is not None:
        floor = _size("--memory-floor", args.memory_floor)
    else:
        floor = default_floor(now.total if now is not None else None)
    if floor == 0:
        return None
    if now is None:
        status("the machine's free memory cannot be read here: --memory-floor is not kept")
        return None
    if now.total and floor >= now.total:
        raise UserError(
            f"--memory-floor {args.memory_floor} leaves this machine nothing: it has "
            f"{human_bytes(now.total)} in all; give a smaller floor, or 0 to keep none"
        )
    return MemoryFloor(gauge, floor, status)


def _follow(args, model, policy, cluster, shard: str, template) -> int:
    """A rank other than 0: load its share and run rank 0's steps until rank 0 stops."""
    import signal

    _, scheduler = _engine(args, model, policy, cluster, shard, template)
    # Ctrl+C reaches every rank: rank 0 lets the answers in flight finish, then tells the
    # others to stop. (mlx.launch stops a rank with SIGTERM when another one fails.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    scheduler.follow()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as rank 0 does: the interpreter's exit can abort after MLX threads ran


def run(args) -> int:
    from mlxkv.commands.common import join_cluster
    from mlxkv.server.app import build_app
    from mlxkv.server.bridge import Bridge
    from mlxkv.server.params import Limits
    from mlxkv.server.run import listen, serve
    from mlxkv.server.served import Served

    key = _check(args)
    _check_memory_flags(args)
    policy = policy_from_args(args)
    defaults = settings_from_args(args)
    template = chat_template_from_args(args)  # a bad file fails before the port is taken
    model = args.model_arg or args.model
    cluster = join_cluster(args)
    shard = "auto"  # one process: nothing to split
    if cluster is not None:
        if args.prefix_cache_dir not in (None, "none"):
            raise UserError(
                "--prefix-cache-dir works in one process: under mlx.launch each host would "
                "keep other files; drop it"
            )
        shard = _split_mode(args, model, cluster.size)
        from mlxkv.engine.distributed import stop_with_launcher

        stop_with_launcher()
    if cluster is not None and not cluster.leader:
        return _follow(args, model, policy, cluster, shard, template)
    # no floor across ranks: each host's free memory is its own, and they decide alike
    floor = _floor(args) if cluster is None else None
    sock = listen(args.host, args.port)  # a busy port fails now, not after loading
    try:
        # a folder it cannot use fails before loading
        conversations, files, stored = _conversations(args), _files(args), _responses(args)
        if floor is not None:
            status(f"memory floor {human_bytes(floor.floor)} kept free for other programs")
        loaded, scheduler = _engine(args, model, policy, cluster, shard, template, floor)
        scheduler.start()
        model_id, names, patterns = _names(loaded, args.served_model_name)
        pooling, embedding_model = _pooling(args, loaded)
        vocab = loaded.config.get("vocab_size")
        served = Served(
            id=model_id,
            names=names,
            patterns=patterns,
            tokenizer=loaded.tokenizer,
            policy=policy,
            limits=Limits(
                max_rows=args.max_batch + args.max_queue,
                vocab_size=vocab if isinstance(vocab, int) else None,
                context_length=loaded.context_length,
                defaults=defaults,
                open_ended=args.max_tokens is None,
            ),
            facts={**_facts(loaded), "embedding_model": embedding_model},
            max_batch=args.max_batch,
            batch_requests=args.batch_requests or max(1, args.max_batch - 1),
            ranks=1 if cluster is None else cluster.size,
            api_key=key,
            max_body=args.max_body,
            pooling=pooling,
            conversations=conversations,
            files=files,
            stored=stored,
        )
        bridge = Bridge(scheduler, args.max_batch, args.max_queue)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        split = f", split over {cluster.size} ranks" if cluster is not None else ""
        serving = (
            f"serving {model_id} ({policy.describe()}, up to {args.max_batch} answers per batch"
            f"{split}) on http://{shown}:{port}/v1" + (" with an API key" if key else "")
        )
        app = build_app(served, bridge)

        def ready() -> None:
            status(serving)
            if app.state.batches is not None:  # batches a stop left go on
                app.state.batches.start()

        batches = app.state.batches
        serve(
            app,
            bridge,
            sock,
            args.shutdown_timeout,
            not args.no_access_log,
            on_ready=ready,
            busy=lambda: batches is not None and batches.busy(),
        )
        scheduler.close(timeout=1.0)
    finally:
        sock.close()
    status("server stopped")
    # Everything is closed and flushed: leave now. The interpreter's own exit can abort
    # ("terminate called without an active exception") once the scheduler's thread has
    # run the model, which would turn a clean stop into exit status 134.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
