"""mlxkv's Textual chat UI. Widgets consume engine events; no MLX code lives here
(the engine does all MLX work on the one worker thread this package starts)."""
