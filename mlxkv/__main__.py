from mlxkv.cli import entry

raise SystemExit(entry())
