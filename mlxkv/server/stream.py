"""A streamed answer as Starlette sends it, with what must run however it ends."""

from __future__ import annotations

from starlette.responses import StreamingResponse


class EventStream(StreamingResponse):
    """A streamed answer (server-sent events, or Ollama's NDJSON); ``on_close`` runs however the
    response ends (even when the client leaves before the first event is sent)."""

    def __init__(self, events, on_close=None, media_type: str = "text/event-stream"):
        super().__init__(
            events,
            media_type=media_type,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.on_close is not None:
                self.on_close()
