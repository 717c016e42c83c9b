"""One way to ask a server for JSON or text, with the endpoint's headers.

Why a module of its own: a launched server (:class:`kimi_perf.bench.RunningServer`), an existing
endpoint (:class:`kimi_perf.endpoint.Endpoint`, ``--perf-url``) and the EAGLE-3 evaluation (counters,
``/server_info``, ``/flush_cache``) each fetched JSON with urllib, and only some of them sent the
bearer token an endpoint may want. Here the request is built once, so a header added for one reaches
all. urllib rather than aiohttp: these are single synchronous calls between measured windows.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

__all__ = ["fetch", "get_json", "get_text", "post"]


def _request(url: str, headers: Mapping[str, str] | None, data: bytes | None) -> urllib.request.Request:
    # a body makes it a POST (urllib's rule); the headers are the only place the endpoint's token goes
    return urllib.request.Request(url, data=data, headers=dict(headers or {}))


def fetch(url: str, headers: Mapping[str, str] | None, timeout: float, data: bytes | None = None) -> bytes:
    """The body at ``url`` (a POST of ``data`` when given); urllib's errors propagate."""
    with urllib.request.urlopen(_request(url, headers, data), timeout=timeout) as r:  # noqa: S310 - loopback or the --perf-url endpoint
        return bytes(r.read())


def get_text(url: str, headers: Mapping[str, str] | None = None, timeout: float = 30.0) -> str:
    """The body at ``url`` as text; urllib's HTTPError/URLError propagate (callers map them)."""
    return fetch(url, headers, timeout).decode()


def get_json(url: str, headers: Mapping[str, str] | None = None, timeout: float = 30.0) -> Any:
    """The JSON at ``url``; urllib's HTTPError/URLError and ValueError (not JSON) propagate."""
    return json.loads(fetch(url, headers, timeout))


def post(url: str, body: bytes, headers: Mapping[str, str] | None = None, timeout: float = 600.0) -> tuple[int, str]:
    """POST ``body``; (status, text) for any HTTP answer, errors included (urllib raises only for the
    connection then)."""
    try:
        with urllib.request.urlopen(_request(url, headers, body), timeout=timeout) as r:  # noqa: S310 - loopback or --perf-url
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
