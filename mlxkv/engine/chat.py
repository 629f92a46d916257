"""A chat conversation on top of a Session: messages, template, regenerate, transcript."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from mlxkv.engine.events import Event, Finished
from mlxkv.engine.session import GenerationSettings, Session
from mlxkv.errors import UserError


class ChatSession:
    def __init__(self, generator: Session, settings: GenerationSettings, system: str = ""):
        self.generator = generator
        self.settings = settings
        self.system = system
        self.messages: list[dict] = []

    # -- the conversation ---------------------------------------------------------------
    def _all_messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def prompt_text(self) -> str:
        messages = self._all_messages()
        # the rendered prompt holds every message: a conversation too long for the context
        # is refused before the template copies it
        self.generator.check_prompt_length(sum(len(m["content"]) for m in messages))
        return self.generator.loaded.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    def answer(self) -> Iterator[Event]:
        """Run the model on the conversation as it stands; the answer (even a cut one)
        joins it. The generator keeps its cache consistent if this breaks off."""
        for event in self.generator.run(self.prompt_text(), self.settings):
            if isinstance(event, Finished):
                self.messages.append({"role": "assistant", "content": event.text})
            yield event

    def send(self, text: str) -> Iterator[Event]:
        """Add a user message and answer it. If no answer comes (an error, or the caller
        walks away before the Finished event), the message is taken back, so the caller
        can offer the text again and the conversation stays as it was."""
        if not text.strip():
            raise UserError("the message is empty; type something to send")
        self.messages.append({"role": "user", "content": text})
        answered = False
        try:
            for event in self.answer():
                answered = answered or isinstance(event, Finished)
                yield event
        finally:
            if not answered and self.messages and self.messages[-1]["role"] == "user":
                self.messages.pop()

    def regenerate(self) -> Iterator[Event]:
        """Answer the last user message again (its previous answer is dropped)."""
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages:
            raise UserError("nothing to regenerate yet; send a message first")
        yield from self.answer()

    def cancel(self) -> None:
        self.generator.cancel()

    def clear(self) -> None:
        self.messages.clear()
        self.generator.reset()

    # -- transcripts ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "model": self.generator.loaded.name,
            "policy": self.generator.policy.to_dict(),
            "system": self.system,
            "messages": self.messages,
        }

    def save(self, path: Path) -> None:
        """Write the transcript to a new file (Markdown for .md, else JSON); an existing
        file, or a link even to nothing, is never written through (FileExistsError)."""
        path = Path(path)
        if path.suffix == ".md":
            parts = [f"# Chat with {self.generator.loaded.name}\n"]
            if self.system:
                parts.append(f"**system**: {self.system}\n")
            parts += [f"**{m['role']}**:\n\n{m['content']}\n" for m in self.messages]
            text = "\n".join(parts)
        else:
            text = json.dumps(self.to_dict(), indent=2, ensure_ascii=False)
        with open(path, "x", encoding="utf-8") as f:  # O_CREAT|O_EXCL
            f.write(text)

    def load(self, path: Path) -> None:
        """Load a JSON transcript; the cache is rebuilt on the next turn."""
        try:
            data = json.loads(Path(path).read_text())
            messages = [{"role": m["role"], "content": m["content"]} for m in data["messages"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"cannot load transcript {path}: {e}") from None
        bad = {m["role"] for m in messages} - {"user", "assistant"}
        if bad:
            raise UserError(f"cannot load transcript {path}: unknown role(s) {sorted(bad)}")
        self.system = data.get("system", "") or ""
        self.messages = messages
        self.generator.reset()
