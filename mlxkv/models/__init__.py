"""Where models come from: the registry, hub downloads, GGUF import, loading."""
