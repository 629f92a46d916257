"""Sampling defaults for chat: the model's own ``generation_config.json`` where it has
them, else a temperature and nucleus that keep a small model from looping.

Greedy decoding with no repetition penalty makes small instruct models repeat a phrase
until the token cap, and makes "regenerate" return the same answer; model authors ship
``generation_config.json`` for exactly this reason.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from mlxkv.engine.session import GenerationSettings
from mlxkv.errors import UserError

# Used for whatever the model's generation_config.json does not say.
FALLBACK = {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}
# generation_config.json key -> GenerationSettings field
_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def model_defaults(model_path: Path) -> dict:
    """The sampling fields a model folder's generation_config.json sets (may be empty)."""
    try:
        data = json.loads((Path(model_path) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("do_sample") is False:
        return {}  # the authors ask for greedy decoding: keep the settings as given
    out = {}
    for key, field in _KEYS.items():
        value = data.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[field] = value
    return out


def chat_sampling(
    settings: GenerationSettings, given: set[str], model_path: Path
) -> tuple[GenerationSettings, str]:
    """``settings`` with every sampling field the user did not give (``given``) taken from
    the model's generation_config.json, else from FALLBACK; and where they came from."""
    from_model = {k: v for k, v in model_defaults(model_path).items() if k not in given}
    fallback = {k: v for k, v in FALLBACK.items() if k not in given and k not in from_model}
    source = "generation_config.json" if from_model else "mlxkv defaults"
    if not from_model and not fallback:
        source = "command line"
    try:
        return replace(settings, **fallback, **from_model), source
    except UserError:  # a generation_config.json value GenerationSettings refuses
        return replace(settings, **fallback), "mlxkv defaults"
