"""The layers point down and nothing imports in a circle (lazy imports included).

Every ``import`` statement counts, also one inside a function: a lazy import still ties
two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lower numbers sit lower; a module may import its own layer or any layer below it.
LAYERS = {
    "mlxkv.errors": 0,
    "mlxkv.paths": 0,
    "mlxkv.files": 0,
    "mlxkv.safetensors_table": 0,
    "mlxkv.policy": 0,
    "mlxkv.backend": 0,
    "mlxkv": 0,  # the package's own __init__
    "mlxkv.caches": 1,
    "mlxkv.memory": 1,
    "mlxkv.models": 2,
    "mlxkv.engine": 3,
    "mlxkv.bench": 4,
    "mlxkv.server": 4,  # the HTTP API over the engine (no MLX code)
    "mlxkv.commands": 5,
    "mlxkv.cli": 6,
    "mlxkv.__main__": 7,
    "tui": 6,
}


def _modules() -> dict[str, Path]:
    mods = {}
    for top in ("mlxkv", "tui"):
        for f in (ROOT / top).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            mods[name] = f
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            candidates = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for c in candidates:
            while c and c not in mods:
                c = c.rsplit(".", 1)[0] if "." in c else ""
            if c and c != name:
                out.add(c)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {n: _imports(n, p, mods) for n, p in mods.items()}


def _layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "tui":
        return "tui"
    return ".".join(parts[:2]) if len(parts) > 1 else "mlxkv"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_every_layer_is_known():
    unknown = {_layer_of(m) for m in _modules()} - set(LAYERS)
    assert not unknown, f"add these to LAYERS: {sorted(unknown)}"


def test_imports_point_down():
    upward = sorted(
        f"{a} imports {b}"
        for a, targets in _graph().items()
        for b in targets
        if LAYERS[_layer_of(b)] > LAYERS[_layer_of(a)]
    )
    assert not upward, "\n".join(upward)


def test_no_module_cycles():
    graph = _graph()
    packages = {m for m, p in _modules().items() if p.name == "__init__.py"}
    # A package's __init__ re-exporting its children is a face, not a cycle.
    cycles = [c for c in _cycles(graph) if not packages & set(c)]
    assert not cycles, cycles


def test_no_layer_cycles():
    layers: dict[str, set[str]] = {}
    for a, targets in _graph().items():
        for b in targets:
            la, lb = _layer_of(a), _layer_of(b)
            if la != lb and "mlxkv" not in (la, lb):
                layers.setdefault(la, set()).add(lb)
    assert not _cycles(layers), _cycles(layers)


def test_the_check_finds_a_cycle():
    """The checker itself: a two-module loop and an upward import are caught."""
    graph = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert _cycles(graph) == [["a", "b"]]
    assert LAYERS[_layer_of("mlxkv.engine.session")] > LAYERS[_layer_of("mlxkv.caches.full")]
