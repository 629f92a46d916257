"""How an embedding model is read, from its sentence-transformers files: ``modules.json``
names a Pooling module, whose ``config.json`` says where (``pooling_mode_lasttoken``: the
last token's state, as Qwen3-Embedding's and other decoder embedding models' do;
``pooling_mode_mean_tokens``: their mean). A chat model has neither file."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

from mlxkv.errors import UserError
from mlxkv.files import read_text

FILE_LIMIT = 1 << 20  # bytes of either file: both are a few hundred
POOLINGS = ("last", "mean")  # the poolings the engine makes (Request.embed)
MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


def trained_pooling(folder: Path) -> tuple[str | None, str | None]:
    """(``"last"`` or ``"mean"``: the pooling the model was trained with, None: no
    sentence-transformers pooling; a note on files that say something else, or None)."""
    if not (folder / "modules.json").is_file():
        return None, None
    try:
        modules = json.loads(read_text(folder / "modules.json", FILE_LIMIT, "modules.json"))
        if not (isinstance(modules, list) and all(isinstance(m, dict) for m in modules)):
            return None, "the model's modules.json is not a list of modules"
        pools = [m for m in modules if str(m.get("type", "")).endswith("models.Pooling")]
        if not pools:
            return None, None
        sub = PurePosixPath(str(pools[0].get("path", "")))
        if sub.is_absolute() or ".." in sub.parts:  # the model's own folder only
            return None, f"modules.json names a Pooling module outside the model ({sub})"
        config = json.loads(read_text(folder / sub / "config.json", FILE_LIMIT, "pooling"))
        if not isinstance(config, dict):
            return None, "the model's pooling config.json is not an object"
    except (UserError, ValueError) as e:
        return None, f"the model's sentence-transformers files cannot be read ({e})"
    modes = [k for k, on in config.items() if k.startswith("pooling_mode_") and on is True]
    if len(modes) == 1 and modes[0] in MODES:
        return MODES[modes[0]], None
    return None, f"the model's sentence-transformers pooling is {', '.join(modes) or 'none'}"
