"""Run the app on uvicorn: listen, serve, and on SIGTERM/Ctrl+C stop taking requests,
let the answers in flight finish for a bounded time, cut the rest with an error, return."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
from contextlib import contextmanager

import uvicorn

from mlxkv.errors import UserError
from mlxkv.server.bridge import ENGINE_SILENCE, Bridge
from mlxkv.server.errors import APIError


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free port), before the model loads,
    so a busy port is reported at once."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise UserError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise UserError(
            f"cannot listen on {host}:{port}: {e.strerror}; pick another --port"
        ) from None
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, with the shutdown drain of the bridge and a plain exit status."""

    def __init__(self, config: uvicorn.Config, bridge: Bridge, grace: float, on_ready, busy):
        super().__init__(config)
        self.bridge = bridge
        self.grace = grace
        self.on_ready = on_ready
        self.busy = busy
        self.loop: asyncio.AbstractEventLoop | None = None
        self.cutting = False

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        # said once requests are taken and a signal drains the server (a SIGTERM before
        # that would end the process with the signal's status, not 0)
        if not self.should_exit:
            self.on_ready()

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        # Answers no connection waits for (a batch's requests, sent in this process) get the
        # same grace as the clients' and are cut with them; what they write is written.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace + ENGINE_SILENCE + 1
        while not self.force_exit and loop.time() < deadline:
            if not self.bridge.rows_in_flight and not self.busy():
                break
            await asyncio.sleep(0.05)

    @contextmanager
    def capture_signals(self):
        # uvicorn re-raises a caught signal after shutting down; a drained server exits 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        original = {s: signal.signal(s, self.handle_exit) for s in sigs}
        try:
            yield
        finally:
            for s, handler in original.items():
                signal.signal(s, handler)

    def handle_exit(self, sig, frame) -> None:
        if self.loop is not None and not self.should_exit:
            self.loop.call_soon_threadsafe(self.bridge.drain, self.grace)
        elif self.loop is not None and not self.cutting:
            # A second signal (uvicorn offers "CTRL+C to force quit"): cut the answers now,
            # each with its shutting_down error; a force quit would cancel them mid-write
            # (a traceback each, a bare 500). A third Ctrl+C still forces the quit.
            self.cutting = True
            self.loop.call_soon_threadsafe(self.bridge.cut)
            return
        super().handle_exit(sig, frame)


class _AnswerCancelled:
    """The app, with a request uvicorn cancels (at the end of its shutdown timeout: a client
    still sending its body; or a forced quit) answered 503 shutting_down in the OpenAI shape
    where nothing was sent yet, and a started response ended, instead of a traceback."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if scope["type"] != "http":
                raise
            try:
                if started:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                else:
                    error = APIError(503, "the server is shutting down", code="shutting_down")
                    await error.response()(scope, receive, send)
            except Exception:  # the connection is gone too
                pass


def serve(
    app,
    bridge: Bridge,
    sock: socket.socket,
    grace: float,
    access_log: bool = True,
    on_ready=None,
    busy=None,
):
    """Serve until a signal; the answers in flight get ``grace`` seconds to finish.
    ``on_ready`` runs once the server takes requests and handles signals; ``busy()`` says
    whether work of the app's own (a batch's records) is still being written at the end."""
    config = uvicorn.Config(
        _AnswerCancelled(app),
        lifespan="off",
        log_level="info",
        access_log=access_log,
        timeout_graceful_shutdown=grace + 5,  # after the bridge has cut what was left
        timeout_keep_alive=5,
    )
    _Server(config, bridge, grace, on_ready or (lambda: None), busy or (lambda: False)).run(
        sockets=[sock]
    )
