"""What counts as this machine: loopback addresses, and requests that come from it.

Without an API key the server is for this machine only. A web page in a browser here can
still send requests to 127.0.0.1 (a cross-site form post, or a DNS name rebound to
127.0.0.1); those carry the page's ``Origin`` or its ``Host`` name, so keyless requests
whose ``Host`` or ``Origin`` names another host are refused. Pages of this machine's
own apps (Electron's ``app://`` and ``file://``, Tauri, VS Code's webviews) are this
machine's: no web site can send their origins.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

APP_SCHEMES = ("app", "file", "tauri", "vscode-webview", "vscode-file")


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def foreign_source(host_header: str | None, origin: str | None) -> str | None:
    """Why a keyless request does not come from this machine (None: it does). An
    ``Origin: null`` (a sandboxed frame, a local file) is not this machine's either."""
    if host_header and not is_loopback(_hostname(f"//{host_header}")):
        return f"Host: {host_header}"
    if origin and not is_local_origin(origin):
        return f"Origin: {origin}"
    return None


def is_local_origin(origin: str) -> bool:
    """A page of this machine: served from a loopback address, or one of its apps'."""
    scheme, sep, _ = origin.partition("://")
    if sep and scheme.lower() in APP_SCHEMES:
        return True
    return scheme.lower() in ("http", "https") and is_loopback(_hostname(origin))


def _hostname(url: str) -> str | None:
    try:
        return urlsplit(url).hostname
    except ValueError:  # a malformed name, e.g. "[::1"
        return None
