"""Rebuild a Hugging Face ``tokenizer.json`` from the vocabulary stored in a GGUF file."""

from __future__ import annotations

# GGUF token types (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4

# GPT-2 style byte-level BPE; what splits text into words before BPE, by
# ``tokenizer.ggml.pre`` (the names llama.cpp uses).
_BYTE_LEVEL = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": True,
    "use_regex": True,
}
_PRE_TOKENIZERS = {
    "default": _BYTE_LEVEL,
    "gpt2": _BYTE_LEVEL,
    # SmolLM: every digit on its own, then GPT-2 byte level.
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL],
    },
}
SUPPORTED_PRE = tuple(sorted(_PRE_TOKENIZERS))


def _as_list(v) -> list:
    return v.tolist() if hasattr(v, "tolist") else list(v)


def build_tokenizer_files(meta: dict) -> tuple[dict, dict]:
    """Return (tokenizer.json, tokenizer_config.json) contents from GGUF metadata.

    Raises ValueError naming what is unsupported.
    """
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"tokenizer model '{model}' (supported: gpt2 byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"pre-tokenizer '{pre}' (supported: {', '.join(SUPPORTED_PRE)})")

    tokens = _as_list(meta["tokenizer.ggml.tokens"])
    types = _as_list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = _as_list(meta.get("tokenizer.ggml.merges", []))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    for m in merges:
        pair = m.split(" ", 1) if isinstance(m, str) else []
        if len(pair) != 2 or pair[0] + pair[1] not in vocab or not all(p in vocab for p in pair):
            raise ValueError(f"merge {m!r} joins tokens that are not in the vocabulary")
    added = [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": t == _CONTROL,
        }
        for i, (tok, t) in enumerate(zip(tokens, types, strict=True))
        if t in (_CONTROL, _USER_DEFINED)
    ]
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _PRE_TOKENIZERS[pre],
        "post_processor": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": False,
            "use_regex": True,
        },
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [m.split(" ", 1) for m in merges],
        },
    }

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(i.item() if hasattr(i, "item") else i)]

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 30,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(_scalar(meta.get("tokenizer.ggml.add_bos_token", False))),
        "add_eos_token": bool(_scalar(meta.get("tokenizer.ggml.add_eos_token", False))),
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tokenizer_json, {k: v for k, v in config.items() if v is not None}


def _scalar(v):
    return v.item() if hasattr(v, "item") else v
