"""The project's own reference engine (a continuous-batching Llama server with EAGLE-3), see server.py.

Only the engine's switches live here, torch-free: the A/B planner and the run history read them
without loading the engine.
"""

from __future__ import annotations

from collections.abc import Mapping

# The planted-slowdown switch, a fraction (0.10 = every decode step 10% slower); see engine.py.
PLANT_ENV = "KIMI_PERF_PLANT_SLOWDOWN"


def planted_fraction(env: Mapping[str, str]) -> float:
    """The planted slowdown ``env`` asks for (0.0 when unset); ValueError names the switch when it is
    not a fraction in [0, 10). The engine refuses to start on that error; the run history records None."""
    raw = (env.get(PLANT_ENV) or "").strip() or "0"
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not 0 <= v < 10:
        raise ValueError(f"{PLANT_ENV}={raw}: a fraction of each decode step, e.g. 0.10")
    return v
