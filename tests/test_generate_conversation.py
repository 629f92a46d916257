"""``mlxkv generate --messages CONV.json --prompt-cache FILE`` on the default model: a
regenerate prefills (almost) nothing, a new user turn prefills only that turn, for the full
and the sink + window policies; and the refusals a user sees."""

from __future__ import annotations

import json

import pytest

TOPICS = ["lighthouses", "bread"]


def conversation() -> list[dict]:
    """About 300 tokens of chat (over twice the 128-token window): a system prompt and two
    exchanges."""
    msgs = [{"role": "system", "content": "You are a patient teacher who answers briefly."}]
    for t in TOPICS:
        msgs.append({"role": "user", "content": f"Tell me something about {t}. " * 6})
        msgs.append(
            {
                "role": "assistant",
                "content": f"Here is a short note about {t}: people have studied {t} "
                "for a long time, and there is always more to learn about them. " * 3,
            }
        )
    msgs.append({"role": "user", "content": "Which of these topics is the oldest?"})
    return msgs


def generate(cli, tmp_path, messages, policy_args, cache="c.safetensors") -> dict:
    conv = tmp_path / "conv.json"
    conv.write_text(json.dumps(messages))
    out = cli(
        "generate", "--messages", str(conv), "--prompt-cache", str(tmp_path / cache),
        "--max-tokens", "8", "--temp", "0", "--json", *policy_args,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.model
@pytest.mark.parametrize(
    "policy_args",
    # the full cache's exact trims are covered by tests/test_engine.py; the window's
    # turn-boundary copy only here
    [pytest.param([], marks=pytest.mark.slow), ["--kv-window", "128", "--kv-sinks", "4"]],
    ids=["full", "sink 4 + window 128"],
)
def test_regenerate_and_next_turn_prefill_only_what_is_new(
    cli, preloaded, default_model, tmp_path, policy_args
):
    msgs = conversation()
    first = generate(cli, tmp_path, msgs, policy_args)
    assert first["prompt_tokens"] > 2 * 128 and first["prompt_tokens_cached"] == 0
    if policy_args:
        assert first["kv_evicted"] > 0  # the window has slid: a naive trim would be wrong

    again = generate(cli, tmp_path, msgs, policy_args)  # regenerate the same answer
    assert again["prompt_tokens"] == first["prompt_tokens"]
    assert again["prompt_tokens"] - again["prompt_tokens_cached"] <= 2
    assert again["text"] == first["text"]  # greedy, and the cache was exact
    assert again["kv_bytes_actual"] == again["kv_bytes_predicted"]

    turn = "And which one is the newest?"
    more = msgs + [
        {"role": "assistant", "content": again["text"]},
        {"role": "user", "content": turn},
    ]
    nxt = generate(cli, tmp_path, more, policy_args)
    prefilled = nxt["prompt_tokens"] - nxt["prompt_tokens_cached"]
    turn_tokens = len(default_model.tokenizer.encode(turn))
    # the new user turn, its template (<|im_end|>, newlines, role headers) and nothing else
    assert turn_tokens < prefilled <= turn_tokens + 12
    assert nxt["kv_bytes_actual"] == nxt["kv_bytes_predicted"]

    fresh = generate(cli, tmp_path, more, policy_args, cache="fresh.safetensors")
    assert fresh["prompt_tokens_cached"] == 0
    assert fresh["text"] == nxt["text"]  # the reused cache answers as an uncached run


@pytest.mark.model
def test_a_cache_file_from_another_policy_is_refused_and_kept(cli, preloaded, tmp_path):
    msgs = [{"role": "user", "content": "Hi"}]
    generate(cli, tmp_path, msgs, ["--kv-window", "64"])
    before = (tmp_path / "c.safetensors").read_bytes()
    conv = tmp_path / "conv.json"
    out = cli(
        "generate", "--messages", str(conv), "--prompt-cache", str(tmp_path / "c.safetensors"),
        "--max-tokens", "4",
    )  # fmt: skip
    assert out.returncode == 2
    assert "made with policy=" in out.stderr.strip().splitlines()[-1]
    assert "Traceback" not in out.stderr
    assert (tmp_path / "c.safetensors").read_bytes() == before


@pytest.mark.model
def test_max_kv_size_keeps_that_many_tokens_in_total(cli, preloaded):
    out = cli(
        "generate", "--prompt", "Write a long story about a lighthouse keeper.",
        "--max-kv-size", "48", "--max-tokens", "16", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["prompt_tokens"] < 48 < r["prompt_tokens"] + r["generation_tokens"]
    assert r["kv_tokens"] == 48
    assert r["policy"]["window"] + r["policy"]["sinks"] == 48
    assert r["kv_evicted"] == r["prompt_tokens"] + r["generation_tokens"] - 48


@pytest.mark.model
def test_openai_forms_of_the_messages_give_the_same_answer(cli, preloaded, tmp_path):
    """A conversation as chat apps export it (OpenAI's developer role, text parts) is the
    plain conversation: the same prompt, the same greedy tokens."""
    plain = conversation()
    forms = [
        {"role": "developer", "content": [{"type": "text", "text": plain[0]["content"]}]},
        *plain[1:-1],
        {"role": "user", "content": [{"type": "text", "text": t + " "} for t in ("Which", "of")]
         + [{"type": "text", "text": "these topics is the oldest?"}]},
    ]  # fmt: skip
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = generate(cli, tmp_path / "a", plain, [])
    b = generate(cli, tmp_path / "b", forms, [])
    assert (b["text"], b["prompt_tokens"]) == (a["text"], a["prompt_tokens"])
    assert a["generation_tokens"] > 0


def test_no_input_names_both_forms_and_stdin(cli, no_model):
    """A newcomer who pipes a prompt in, or gives none, learns how to give it."""
    for stdin in ("What is 2+2?\n", None):
        out = cli("generate", "--max-tokens", "3", stdin=stdin)
        assert out.returncode == 2, out.stderr
        assert out.stderr == (
            "mlxkv generate: error: give the input as --prompt TEXT (--prompt - reads stdin) "
            "or --messages CONV.json (one of them)\n"
        )


@pytest.mark.parametrize(
    "content, args, message",
    [
        ("[]", [], 'conv.json must be a non-empty list of {"role", "content"} objects'),
        ("{", [], "not valid JSON"),
        ('[{"role": "robot", "content": "x"}]', [], "conv.json has message 0 that is not {"),
        ('[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]', [],
         "conv.json has message 0 that is not {"),
        ('[{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]', [],
         "conv.json has a system message at 1; a system message may only come first"),
        ('[{"role": "system", "content": "a"}]', [], "conv.json has no user message to answer"),
        ('[{"role": "user", "content": "a"}]', ["--prompt", "x"], "one of them"),
        ('[{"role": "user", "content": "a"}]', ["--raw"], "does not apply to --messages"),
        ('[{"role": "user", "content": "a"}]', ["--prompt-cache", "c.bin"],
         "must end in .safetensors"),
        ('[{"role": "user", "content": "a"}]', ["--max-kv-size", "6", "--kv-sinks", "4"],
         "--max-kv-size 6 with 4 sink tokens leaves a window of 2"),
    ],
)  # fmt: skip
def test_bad_messages_one_line_exit_2(cli, no_model, tmp_path, content, args, message):
    conv = tmp_path / "conv.json"
    conv.write_text(content)
    out = cli("generate", "--messages", str(conv), *args)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1
