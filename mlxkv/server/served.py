"""What a server serves: its one model, the names it answers to, and the rules and stores it
runs it by (read by every endpoint)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from mlxkv.policy import KVPolicy
from mlxkv.server.conversation_store import ConversationStore
from mlxkv.server.file_store import FileStore
from mlxkv.server.params import Limits
from mlxkv.server.response_store import ResponseStore


@dataclass
class Served:
    """The one model this server runs and the rules it runs it by."""

    id: str  # the name /v1/models lists
    names: set[str]  # every name a request's ``model`` may give (alias, repo id)
    tokenizer: object  # chat template and token texts (no MLX)
    policy: KVPolicy  # the default KV policy
    patterns: tuple[str, ...] = ()  # shell patterns of more names ('claude-*', '*')
    limits: Limits = field(default_factory=Limits)
    max_batch: int = 16
    batch_requests: int = 15  # a batch's requests in flight at once (/v1/batches)
    ranks: int = 1  # processes the model is split over (mlx.launch); rank 0 serves
    api_key: str | None = None
    max_body: int = 8 * 2**20
    stored: ResponseStore = field(default_factory=ResponseStore)  # Responses' store: true
    conversations: ConversationStore = field(default_factory=ConversationStore)
    files: FileStore | None = None  # uploads and batch results (None: no files, no batches)
    facts: dict = field(default_factory=dict)  # size, family, context... (Ollama's listings)
    pooling: str = "last"  # how an embedding pools the final hidden states: "last", "mean"
    started: int = field(default_factory=lambda: int(time.time()))

    def serves(self, name: str) -> bool:
        return name in self.names or any(fnmatchcase(name, p) for p in self.patterns)
