"""``mlxkv serve``: an OpenAI-compatible HTTP API over the engine's request scheduler.

No MLX code lives here: requests are validated and rendered to token ids, handed to the
scheduler (which runs every model call on its own thread), and its events come back to the
event loop through a thread-safe callback.
"""
