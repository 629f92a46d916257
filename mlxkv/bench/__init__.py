"""``mlxkv bench``: mlxkv side by side with plain mlx-lm on one machine, in one run.

One concept per module: ``scale`` (run sizes), ``machine`` (what ran it), ``corpus`` (token
stream from any text file), ``stream`` (one cache through a long token stream),
``engine_overhead``, ``policies``, ``quality``, ``roofline``, ``batch``, ``prediction``,
``plots`` and ``report``; ``run`` ties them together.
"""
