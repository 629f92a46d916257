"""What MLX holds beside a window cache's KV while a request that drafts decodes: a copying
prompt (drafts are taken), sink 4 + a window the answer evicts, on the default model.

    python benchmarks/draft_memory.py [--windows 128,256] [--max-tokens 120] [--draft-tokens 8]

Per window: the KV (the caches' nbytes) and, at the step where MLX held the most beyond the
request's reservation (KV, sinks rotated ahead, undo log), what it held and that
reservation (a draft step's logits, in the runtime share, are the rest).
"""

from mlxkv.backend import setup_blas

setup_blas()

import argparse  # noqa: E402
import gc  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402

from mlxkv.engine.admission import MemoryBudget  # noqa: E402
from mlxkv.engine.request import GenerationSettings  # noqa: E402
from mlxkv.engine.scheduler import Request, Scheduler  # noqa: E402
from mlxkv.models.loader import load  # noqa: E402
from mlxkv.models.resolve import resolve  # noqa: E402
from mlxkv.policy import KVPolicy  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "austen.txt"


def run(loaded, ids, window: int, max_tokens: int, drafts: int) -> str:
    policy = KVPolicy(window=window, sinks=4)
    settings = GenerationSettings(max_tokens=max_tokens)
    warm = Scheduler(loaded, policy, draft_tokens=drafts)  # MLX's own first-use buffers
    handle = warm.submit(Request(ids, settings))
    while not handle.done:
        warm.step()
    del warm, handle
    gc.collect()
    before = mx.get_active_memory()
    memory = MemoryBudget(loaded, 1 << 40, 4, 512, draft_tokens=drafts)  # never refuses
    scheduler = Scheduler(loaded, policy, memory=memory, draft_tokens=drafts)
    handle = scheduler.submit(Request(ids, settings))
    worst, held, reserved, kv = -(1 << 40), 0, 0, 0
    while not handle.done:
        scheduler.step()
        gc.collect()
        m = scheduler.status()["memory"]
        now = mx.get_active_memory() - before
        kv = max(kv, m["kv_bytes_actual"])
        if m["reserved_bytes"] and now - m["reserved_bytes"] > worst:
            worst, held, reserved = now - m["reserved_bytes"], now, m["reserved_bytes"]
    mib = 2**20
    return (
        f"window {window}: KV {kv / mib:.2f} MiB; at the step that held the most beyond its "
        f"reservation, MLX held {held / mib:.2f} MiB of which {reserved / mib:.2f} MiB "
        f"reserved ({worst / mib:+.2f} MiB); drafts {scheduler.drafted}, taken "
        f"{scheduler.accepted}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", default="128,256", help="window sizes, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=120, help="answer tokens")
    ap.add_argument("--draft-tokens", type=int, default=8, help="most drafts a step checks")
    args = ap.parse_args()
    loaded = load(resolve("smollm2-135m").path)
    passage = CORPUS.read_text()[20000:21500]
    messages = [{"role": "user", "content": f"Copy this passage word for word:\n\n{passage}"}]
    ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    print(f"prompt {len(ids)} tokens, {args.max_tokens} answer tokens, sink 4 + window")
    for w in (int(x) for x in args.windows.split(",")):
        print(run(loaded, ids, w, args.max_tokens, args.draft_tokens), flush=True)


if __name__ == "__main__":
    main()
