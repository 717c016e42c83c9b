"""Prometheus text parsing for engine counters (vLLM's spec-decode counters, ours, SGLang's gauges).

Why a wrapper around prometheus_client's parser: engines' /metrics are read before and after a
measured window, and a malformed exposition (a truncated response, a proxy's HTML error page) must be
a clear error, not a silent zero that turns into "acceptance 0".
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["MetricsParseError", "counter_sum", "parse_prometheus"]

Sample = tuple[str, tuple[tuple[str, str], ...]]


class MetricsParseError(ValueError):
    pass


def parse_prometheus(text: str) -> dict[Sample, float]:
    """Map (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[Sample, float] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    except Exception as e:  # noqa: BLE001 - the library raises ValueError, TypeError, IndexError...
        snippet = text[:120].replace("\n", "\\n")
        raise MetricsParseError(f"not Prometheus text exposition ({type(e).__name__}: {e}); starts with {snippet!r}") from None
    return out


def counter_sum(samples: Mapping[Sample, float], name: str, **labels: str) -> float | None:
    """Sum of all samples named ``name`` (summing over engines/models) matching ``labels``; None if absent."""
    vals = [v for (n, lab), v in samples.items() if n == name and all(dict(lab).get(k) == w for k, w in labels.items())]
    return sum(vals) if vals else None
