from mlxkv.cli import main

raise SystemExit(main())
