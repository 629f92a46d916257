"""The memory model: config.json -> per-layer cache layout -> bytes; budget; system probe.

Imports are lazy so ``mlxkv plan`` answers without importing MLX when the layout is known.
Entry points:

* ``layout_for(config)`` (store) / ``probe(config)``: the per-layer cache layout
* ``KVPredictor(layout, policy, batch, kv_dtype)``: ``.advance(n)`` per model call
* ``estimate_model(source, ...)``: everything ``mlxkv plan`` reports (``source``: a
  ``ModelSource``, from ``mlxkv.models.resolve.resolve_config``)
* ``check_fits(path, policy, context)``: raise UserError if a model will not fit
* ``default_kv_dtype(config)`` / ``default_weight_dtype(config)``: the engine's dtype rule
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "layout_for": "mlxkv.memory.store",
    "probe": "mlxkv.memory.probe",
    "KVPredictor": "mlxkv.memory.predictor",
    "KVBytes": "mlxkv.memory.predictor",
    "predict": "mlxkv.memory.predictor",
    "estimate_model": "mlxkv.memory.estimate",
    "check_fits": "mlxkv.memory.estimate",
    "system_memory": "mlxkv.memory.system",
    "parse_size": "mlxkv.memory.system",
    "default_kv_dtype": "mlxkv.memory.dtypes",
    "default_weight_dtype": "mlxkv.memory.dtypes",
    "BadInput": "mlxkv.memory.config",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mlxkv.memory' has no attribute {name!r}")
