"""Reading ``GET /v1/status`` of an ``mlxkv serve`` for ``mlxkv top``: the URL, the key,
and one line saying why a server cannot be read."""

from __future__ import annotations

import httpx


class Unreachable(Exception):
    """The server cannot be read (one line, said as is)."""


def base_url(url: str) -> str:
    """``host:port``, ``http://host:port/``, ``.../v1``: the server's root URL."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def read_status(response: httpx.Response, url: str) -> dict:
    """The status dict of an answer to ``GET /v1/status``, or Unreachable saying why not."""
    if response.status_code == 401:
        raise Unreachable(
            f"{url} wants an API key: give it with --api-key or MLXKV_API_KEY"
            if "authorization" not in response.request.headers
            else f"{url} refused the API key (HTTP 401)"
        )
    if response.status_code != 200:
        raise Unreachable(
            f"{url} is not an mlxkv server: GET /v1/status answered HTTP {response.status_code}"
        )
    try:
        status = response.json()
    except ValueError:
        status = None
    if not (
        isinstance(status, dict)
        and isinstance(status.get("running"), list)
        and "waiting" in status
        and "model" in status
    ):
        raise Unreachable(f"{url} is not an mlxkv server: GET /v1/status has no scheduler status")
    return status


def failure(e: httpx.HTTPError, url: str) -> str:
    """One line for an HTTP failure."""
    if isinstance(e, httpx.ConnectError):
        return f"cannot connect to {url} (is mlxkv serve running there?)"
    if isinstance(e, httpx.TimeoutException):
        return f"{url} did not answer in time"
    if isinstance(e, httpx.UnsupportedProtocol | httpx.InvalidURL):
        return f"not an http(s) URL: {url}"
    return f"{url}: {type(e).__name__}: {e}"


def fetch(url: str, api_key: str | None, timeout: float = 5.0) -> dict:
    try:
        response = httpx.get(f"{url}/v1/status", headers=headers(api_key), timeout=timeout)
    except httpx.InvalidURL:
        raise Unreachable(f"not a URL: {url}") from None
    except httpx.HTTPError as e:
        raise Unreachable(failure(e, url)) from None
    return read_status(response, url)
