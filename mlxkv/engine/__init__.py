"""The engine: load a model with a cache policy, run chat turns and completions, report
events with live KV statistics. Knows nothing of any UI."""
