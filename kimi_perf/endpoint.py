"""An existing serving endpoint as the engine under test (``--perf-url``).

Why: GPU CI and Kubernetes setups deploy the server separately from the job that benchmarks it, and
every anchor client (``vllm bench serve``, ``sglang.bench_serving``, GuideLLM, AIPerf) takes a base URL.
With ``--perf-url`` the throughput tests, the concurrency sweep and the SLO sweep measure that server
with the same client, workloads and gates as a launched one; what needs a launch of its own (the A/B
relaunches, engine CPU time, hidden-state capture flags, EAGLE-3 servers) skips, naming why.

Prompts are token ids (exact input lengths on every engine), so the client needs the served model's
tokenizer: ``--perf-tokenizer DIR`` or the profile's model. A bearer token, when the endpoint wants one,
comes from the environment variable ``--perf-api-key-env`` names (default ``KIMI_PERF_API_KEY``), never
from the command line, where it would land in shell history and CI logs.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .httpjson import get_json

__all__ = ["DEFAULT_API_KEY_ENV", "Endpoint", "EndpointError", "parse_endpoint"]

DEFAULT_API_KEY_ENV = "KIMI_PERF_API_KEY"


class EndpointError(ValueError):
    """A ``--perf-url`` that cannot be used; the message names the option and the fix."""


@dataclass(frozen=True)
class Endpoint:
    """Where the server under test already runs, and how to talk to it."""

    url: str  # scheme://host[:port], no trailing slash
    tokenizer: Path | None = None  # tokenizer directory for the token-id prompts (None: the profile's model)
    api_key_env: str = DEFAULT_API_KEY_ENV
    served_model: str | None = None  # None: the first model /v1/models lists
    probed: dict[str, Any] = field(default_factory=dict, compare=False)

    def headers(self) -> dict[str, str]:
        """The Authorization header when the token variable is set (empty otherwise)."""
        token = os.environ.get(self.api_key_env, "")
        return {"Authorization": f"Bearer {token}"} if token else {}

    def get_json(self, path: str, timeout: float = 10.0) -> Any:
        return get_json(self.url + path, self.headers(), timeout)

    def probe(self) -> dict[str, Any]:
        """Model name, engine kind and version as the endpoint reports them; EndpointError when it
        does not answer ``/v1/models`` (wrong URL, not OpenAI-compatible, or a missing token)."""
        if self.probed:
            return self.probed
        try:
            models = self.get_json("/v1/models")
        except urllib.error.HTTPError as e:
            hint = (f" (the endpoint wants a token: export {self.api_key_env}=...)" if e.code in (401, 403)
                    and not self.headers() else "")
            raise EndpointError(f"--perf-url {self.url}: GET /v1/models answered HTTP {e.code}{hint}") from None
        except (OSError, ValueError) as e:
            raise EndpointError(f"--perf-url {self.url}: GET /v1/models failed ({type(e).__name__}: {e}); is the "
                                "server up and OpenAI-compatible?") from None
        ids = [m.get("id") for m in (models.get("data") or []) if isinstance(m, dict)]
        model = self.served_model or (ids[0] if ids else None)
        if model is None:
            raise EndpointError(f"--perf-url {self.url}: /v1/models lists no model; pass --perf-served-model NAME")
        if self.served_model and ids and self.served_model not in ids:
            raise EndpointError(f"--perf-served-model {self.served_model}: the endpoint serves {ids}")
        kind, version = "openai", None
        for path, k in (("/version", "vllm"), ("/server_info", "sglang")):
            try:
                info = self.get_json(path)
            except (OSError, ValueError):
                continue
            if isinstance(info, dict) and info.get("version"):
                version = str(info["version"])
                kind = "reference" if "kimi-perf-reference" in version or info.get("source_root") else k
                break
        self.probed.update(model=model, kind=kind, version=version, models=ids)
        return self.probed


def parse_endpoint(url: str | None, *, tokenizer: str | None, api_key_env: str | None,
                   served_model: str | None) -> Endpoint | None:
    """The ``--perf-url`` group of options, checked at parse time (None without ``--perf-url``)."""
    if not url:
        for opt, v in (("--perf-tokenizer", tokenizer), ("--perf-served-model", served_model)):
            if v:
                raise EndpointError(f"{opt} applies to --perf-url only: add --perf-url URL or drop {opt}")
        return None
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/") or u.query:
        raise EndpointError(f"--perf-url {url}: give the server's base URL, scheme://host[:port] (e.g. "
                            "http://127.0.0.1:8000), without /v1 or a path: the client adds /v1/completions")
    tok = None
    if tokenizer:
        tok = Path(tokenizer).expanduser()
        if not ((tok / "tokenizer.json").is_file() or (tok / "tokenizer_config.json").is_file()):
            raise EndpointError(f"--perf-tokenizer {tokenizer}: no tokenizer.json or tokenizer_config.json there; "
                                "point it at the served model's directory (or a copy of its tokenizer files)")
    env = api_key_env or DEFAULT_API_KEY_ENV
    if not env.replace("_", "").isalnum():
        raise EndpointError(f"--perf-api-key-env {env}: the NAME of an environment variable, not the token")
    return Endpoint(url=f"{u.scheme}://{u.netloc}", tokenizer=tok, api_key_env=env, served_model=served_model)
