"""What a caller asks the engine for: sampling and limits, and the prompt's token ids."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mlxkv.errors import UserError, one_line

# The answer tokens the scheduler reserves memory for at a time when an answer has no limit
# of its own (``open_ended``).
RESERVE_STEP = 512


@dataclass
class GenerationSettings:
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    repetition_penalty: float | None = None
    repetition_context: int = 20  # the tokens the repetition penalty looks back over (mlx-lm's)
    # OpenAI's penalties over the answer so far: once per token seen / per occurrence
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # The answer continues the prompt's text (a raw completion, not a chat message): its
    # text keeps the space its first token starts with ("... is" + " Paris").
    continues: bool = False
    # XTC (exclude top choices, as mlx-lm's sampler): with this probability each step drops
    # every token above ``xtc_threshold`` but the least likely of them
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # The end of the answer (EOS, a stop string) held back for its first ``min_tokens``
    # tokens, or for good with ``ignore_eos`` (EOS alone): vLLM's and llama.cpp's fields,
    # which benchmarks send for answers of a set length
    min_tokens: int = 0
    ignore_eos: bool = False
    # A code completion's ends (llama.cpp's n_indent and t_max_predict_ms): a line indented
    # less than this ends the answer; past this many seconds of decoding, a line break does
    min_indent: int = 0
    time_limit: float | None = None
    prefill_step: int = 512
    # An llguidance grammar the answer must match (constrained decoding; engine/grammar.py)
    grammar: str | None = None
    # A grammar each tool call the model chooses to make must match: held from the
    # tokenizer's tool-call start marker until it is complete (engine/grammar.py)
    call_grammar: str | None = None
    # The most reasoning tokens a thinking model writes before its think block is closed
    # for it (engine/thinking.py); None: no limit
    think_budget: int | None = None
    # No limit was asked (OpenAI's and Ollama's default): the answer runs until the model
    # stops or ``max_tokens`` (the model's context) is reached; the scheduler reserves its
    # memory RESERVE_STEP tokens at a time and ends it ("length") where memory runs out.
    open_ended: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise UserError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise UserError(f"--temp must be 0 or more, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.prefill_step < 1:
            raise UserError(f"--prefill-step must be at least 1, got {self.prefill_step}")
        if self.min_tokens < 0:
            raise UserError(f"min_tokens must be 0 or more, got {self.min_tokens}")
        if not 0 <= self.xtc_probability <= 1:
            raise UserError(f"xtc_probability must be in [0, 1], got {self.xtc_probability}")
        if not 0 <= self.xtc_threshold <= 0.5:  # mlx-lm's apply_xtc raises beyond it
            raise UserError(f"xtc_threshold must be in [0, 0.5], got {self.xtc_threshold}")


def settings_to_json(s: GenerationSettings) -> dict:
    """``s`` as JSON, for another rank of ``mlx.launch``."""
    return asdict(s)


def settings_from_json(d: dict) -> GenerationSettings:
    """:func:`settings_to_json`'s JSON back as settings (its tuples came back as lists)."""
    s = dict(d)
    s["stop"] = tuple(s.get("stop") or ())
    s["logit_bias"] = tuple((int(t), float(b)) for t, b in s.get("logit_bias") or ())
    return GenerationSettings(**s)


def encode_prompt(tokenizer, text: str, specials: bool = True) -> list[int]:
    """Token ids of a whole prompt: the tokenizer's BOS is added unless the text (a chat
    template's output, say) already starts with it (or ``specials`` is false: the text's
    own tokens alone). Every front end encodes with this."""
    bos = getattr(tokenizer, "bos_token", None)
    return encode_text(tokenizer, text, specials and bool(bos) and not text.startswith(bos))


def encode_text(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """``tokenizer.encode``, its failure a UserError. With ``add_special_tokens`` the
    tokenizer adds what it was made to add (an embedding model's end-of-text marker)."""
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except BaseException as e:
        # A tokenizer's Rust code that panics (a crafted tokenizer.json's regex past its
        # backtracking limit) raises pyo3's PanicException, a BaseException.
        if type(e).__name__ != "PanicException":
            raise
        raise UserError(f"the model's tokenizer failed on this text: {one_line(e)}") from None


def most_prompt_characters(tokenizer, context_length: int | None) -> int | None:
    """Characters no prompt can exceed and still fit ``context_length`` tokens: the context
    times the longest token's text (16 at least). Longer prompts are refused before the
    tokenizer reads them (20 MB took 5.4 GB and 34 s to tokenize and refuse). None: no
    context, or a tokenizer without a vocabulary to list."""
    if not context_length:
        return None
    try:
        longest = max(map(len, tokenizer.get_vocab()), default=1)
    except Exception:  # a tokenizer without a vocabulary to list: no bound
        return None
    return context_length * max(longest, 16)


def check_prompt_characters(characters: int, most: int | None, context: int, fix: str) -> None:
    """Refuse a prompt of more ``characters`` than ``most`` (most_prompt_characters), with
    what to do about it (``fix``)."""
    if most is not None and characters > most:
        raise UserError(
            f"the prompt is {characters} characters, more than the model's context of "
            f"{context} tokens can hold; {fix}"
        )


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
