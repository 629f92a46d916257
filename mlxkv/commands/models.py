"""``mlxkv models``: the registry, and what of it is present locally."""

from __future__ import annotations

HELP = (
    "list the model registry (models.toml; MLXKV_MODELS=FILE names your own) and mark the "
    "models present locally"
)


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print JSON")


def _present(entry) -> str | None:
    from mlxkv.models.resolve import _hub_cached
    from mlxkv.paths import models_dir

    if _hub_cached(entry.hf_repo):
        return "hub cache"
    if (models_dir() / entry.alias / "config.json").is_file():
        return "offline copy"
    return None


def run(args) -> int:
    import json

    from mlxkv.models.registry import load_registry

    reg = load_registry()
    rows = []
    for alias, e in reg.models.items():
        rows.append(
            {
                "alias": alias,
                "default": alias == reg.default,
                "name": e.name,
                "hf_repo": e.hf_repo,
                "params": e.params,
                "attention": e.attention,
                "offline": e.offline.pypi if e.offline else None,
                "present": _present(e),
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    w = max(len(r["alias"]) for r in rows)
    for r in rows:
        mark = "*" if r["present"] else " "
        default = " (default)" if r["default"] else ""
        where = f"  [{r['present']}]" if r["present"] else ""
        print(f"{mark} {r['alias']:<{w}}  {r['params']:>8}  {r['hf_repo']}{default}{where}")
        print(f"  {'':<{w}}  {'':>8}  {r['attention']}")
    print("\n* present locally. 'mlxkv pull ALIAS' fetches one.")
    return 0
