"""Dummy-weight model directories (``--load-format dummy``) for shape-only throughput profiles.

Why: gating a Llama-3.1-8B-shaped decode on a GPU runner needs the 16 GB of weights to be read every
step, not their values. A directory with the published ``config.json`` and a tokenizer is enough for
engines that support dummy loading (ours, vLLM, SGLang). The tokenizer is the embedded model's:
random-id workloads only need ids below its vocabulary size.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from .embedded import cache_root, ensure_embedded_model, file_lock

__all__ = ["ensure_dummy_model"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def ensure_dummy_model(shape_name: str, config: dict) -> Path:
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    out = cache_root() / "models" / f"dummy-{shape_name}-{digest}"
    if (out / "COMPLETE").is_file():
        return out
    tok_src = ensure_embedded_model().path
    with file_lock(out.parent / f".{out.name}.lock", what=f"writing dummy model {shape_name}"):
        if (out / "COMPLETE").is_file():
            return out
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=1))
        for f in _TOKENIZER_FILES:
            if (tok_src / f).is_file():
                shutil.copy2(tok_src / f, out / f)
        (out / "COMPLETE").write_text(json.dumps({"dummy": shape_name}))
    return out
