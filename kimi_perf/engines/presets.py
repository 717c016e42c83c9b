"""Named NCCL environment presets, selectable per engine, per test and as a pytest parameter.

Why presets and not free-form env: the seed deployment (Kimi-K2.5, TP 8 over PCIe, all-reduce 51.5% of
decode time) got its vLLM speed from one specific NCCL set; a gate has to name that set, apply it
identically to every engine process (and their children, which inherit the environment), and A/B it
against the default in the same session.

Every preset also pins the multicast switches off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1): the lent multi-GPU hosts require it, and a preset that silently toggled
NVLink SHARP would measure a different machine.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["NCCL_PRESETS", "SAFETY_ENV", "nccl_env"]

SAFETY_ENV: Mapping[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

NCCL_PRESETS: Mapping[str, Mapping[str, str]] = {
    # NCCL's own choices
    "default": {},
    # the set that made vLLM fast on 8x RTX PRO 6000 over PCIe (seed team's report, docs/sources.md)
    "seed-pcie-tuned": {
        "NCCL_PROTO": "LL",
        "NCCL_ALGO": "Ring",
        "NCCL_P2P_LEVEL": "SYS",
        "NCCL_MAX_NCHANNELS": "16",
        "NCCL_BUFFSIZE": "16777216",
        "NCCL_NTHREADS": "512",
    },
    # LL alone: isolates the protocol from the ring/channel settings in an A/B
    "ll-only": {"NCCL_PROTO": "LL"},
}


def nccl_env(preset: str | None) -> dict[str, str]:
    """The environment for ``preset`` (None = "default"), safety switches included."""
    name = preset or "default"
    if name not in NCCL_PRESETS:
        raise ValueError(f"unknown NCCL preset {name!r}; presets: {', '.join(NCCL_PRESETS)}")
    return {**SAFETY_ENV, **NCCL_PRESETS[name]}
