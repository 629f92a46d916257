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
from mlxkv.server.bridge import Bridge


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

    def __init__(self, config: uvicorn.Config, bridge: Bridge, grace: float):
        super().__init__(config)
        self.bridge = bridge
        self.grace = grace
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

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
        if not self.should_exit and self.loop is not None:
            self.loop.call_soon_threadsafe(self.bridge.drain, self.grace)
        super().handle_exit(sig, frame)


def serve(app, bridge: Bridge, sock: socket.socket, grace: float, access_log: bool = True):
    """Serve until a signal; the answers in flight get ``grace`` seconds to finish."""
    config = uvicorn.Config(
        app,
        lifespan="off",
        log_level="info",
        access_log=access_log,
        timeout_graceful_shutdown=grace + 5,  # after the bridge has cut what was left
        timeout_keep_alive=5,
    )
    _Server(config, bridge, grace).run(sockets=[sock])
