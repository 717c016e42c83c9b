"""An SGLang-layout server's hidden states over HTTP, named in the suite's layer convention.

Why its own module: two callers need it and one of them must not depend on the other's reader. The
alignment tests compare these states with transformers and with the stored training features
(:mod:`kimi_perf.alignment.extract`, which reads the EAGLE-3 pipeline's feature shards), and the
pipeline's ``http-aux`` feature backend (:mod:`kimi_perf.eagle3.features`) captures training features
through the same requests; if the backend imported ``extract`` the two would import each other. The
layout is SGLang's ``meta_info.hidden_states`` from ``/generate``, which the reference engine, SGLang
0.5.17 (final-norm output, or the drafter's packed aux layers while serving EAGLE-3) and SGLang 0.5.23
(also ``--enable-return-aux-hidden-states``) all answer.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .hidden import AlignmentSetupError, HiddenStates, Layer, Provenance

__all__ = ["REFERENCE_ENGINE_NAME", "ServerLayers", "parse_sglang_hidden_states", "server_hidden_states",
           "server_info", "server_layers"]


def parse_sglang_hidden_states(rows: list[Any], layers: Sequence[Layer], hidden: int) -> dict[Layer, np.ndarray]:
    """SGLang's ``meta_info.hidden_states``: a 2-D prefill block, then 1-D rows (one per fed-back
    generated token) or 2-D blocks (speculative verify steps). Concatenated aux rows are split into
    ``layers`` of width ``hidden``."""
    if not rows:
        raise AlignmentSetupError("meta_info.hidden_states is empty")
    blocks = []
    for i, r in enumerate(rows):
        a = np.asarray(r, dtype=np.float32)
        if a.ndim == 1:
            a = a[None, :]
        if a.ndim != 2:
            raise AlignmentSetupError(f"hidden_states[{i}] has shape {a.shape}; expected rows of width {len(layers) * hidden}")
        blocks.append(a)
    m = np.concatenate(blocks, axis=0)
    if m.shape[1] != len(layers) * hidden:
        raise AlignmentSetupError(f"hidden-state rows are {m.shape[1]} wide, expected {len(layers)} layers x {hidden}: "
                                  "the server's --return-aux-hidden-state-layer-ids differ from the ones asked for")
    return {k: m[:, i * hidden : (i + 1) * hidden] for i, k in enumerate(layers)}


def server_info(base_url: str) -> dict[str, Any]:
    for path in ("/server_info", "/get_server_info"):
        try:
            with urllib.request.urlopen(base_url.rstrip("/") + path, timeout=30) as r:  # noqa: S310 - loopback
                return json.loads(r.read())
        except OSError:
            continue
    raise AlignmentSetupError(f"{base_url} has no /server_info: not an SGLang-compatible server")


# what this suite's reference engine reports as /server_info "engine"; SGLang reports no such key
REFERENCE_ENGINE_NAME = "kimi-perf-reference"
_FAMILIES = {"llama": "sglang-llama", "deepseek": "sglang-deepseek", "kimi": "sglang-deepseek",
             "sglang-llama": "sglang-llama", "sglang-deepseek": "sglang-deepseek"}


@dataclass(frozen=True)
class ServerLayers:
    """Which layers a server's ``meta_info.hidden_states`` columns are, in the suite's convention
    ("residual stream entering layer k"; "final" = final-norm output), and how that was decided."""

    layers: tuple[Layer, ...]
    convention: str  # "reference", "sglang-llama", "sglang-deepseek", or "final"
    server_ids: tuple[Layer, ...] | None  # the ids as the server/drafter names them; None = its default
    how: str  # one line for provenance notes


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _target_config(info: dict[str, Any]) -> dict[str, Any] | None:
    """The target's config.json, when the server's ``model_path`` is a directory on this machine."""
    mp = info.get("model_path")
    if not mp:
        return None
    cfg = _read_json(Path(str(mp)) / "config.json")
    if cfg is not None and isinstance(cfg.get("text_config"), dict):  # multimodal wrappers (Kimi-K2.5)
        return {**cfg["text_config"], "architectures": cfg.get("architectures") or []}
    return cfg


def _sglang_convention(info: dict[str, Any], model_family: str | None) -> str:
    from .layers import sglang_aux_convention

    if model_family is not None:
        if model_family not in _FAMILIES:
            raise AlignmentSetupError(f"model_family {model_family!r}: use one of {sorted(_FAMILIES)}")
        return _FAMILIES[model_family]
    cfg = _target_config(info)
    if cfg is None:
        raise AlignmentSetupError(
            f"cannot tell the SGLang target's model family (its config.json under model_path "
            f"{info.get('model_path')!r} is not readable here): pass model_family='llama' or 'deepseek'")
    try:
        return sglang_aux_convention(cfg.get("architectures") or [])
    except ValueError as e:
        raise AlignmentSetupError(str(e)) from None


def _num_layers(info: dict[str, Any], num_layers: int | None) -> int | None:
    if num_layers is not None:
        return num_layers
    if isinstance(info.get("num_layers"), int):  # the reference engine reports it
        return int(info["num_layers"])
    cfg = _target_config(info)
    n = (cfg or {}).get("num_hidden_layers")
    return int(n) if isinstance(n, int) else None


def _served(ids: list[int] | None, conv: str, n: int | None) -> tuple[int, ...]:
    from .layers import served_aux_layers

    try:
        return served_aux_layers(ids, conv, n)
    except ValueError as e:
        raise AlignmentSetupError(f"{e} (pass num_layers)") from None


def server_layers(info: dict[str, Any], *, model_family: str | None = None, num_layers: int | None = None,
                  draft_config: dict[str, Any] | None = None) -> ServerLayers:
    """Name the columns of a server's ``meta_info.hidden_states`` in the suite's convention.

    - Reference engine (``engine`` == "kimi-perf-reference"): its ids already are "entering layer k".
    - SGLang aux mode (0.5.23 ``--enable-return-aux-hidden-states``; not in 0.5.17): the ids of
      ``--return-aux-hidden-state-layer-ids`` go through the model's ``set_eagle3_layers_to_capture``
      (python/sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py), so the
      family's rule applies (:func:`kimi_perf.engines.reference.drafter_model.effective_aux_layers`); no ids = [2, N//2, N-3].
    - SGLang serving EAGLE-3 with a drafter and ``return_hidden_states``: the rows are the packed aux
      states, not the final norm (0.5.17 and 0.5.23 layers/logits_processor.py
      ``LogitsProcessor._get_hidden_states_to_store`` stores ``pack_aux_hidden_states(aux)`` whenever aux
      states exist; the target prefill and verify run with CaptureHiddenMode.FULL,
      speculative/eagle_worker_v2.py ``forward_batch_generation``), for the ids in the drafter's
      ``eagle_config.eagle_aux_hidden_state_layer_ids`` (``draft_config``, else read from
      ``speculative_draft_model_path``), with the family's rule.
    - SGLang without speculative decoding: the final-norm output ("final").

    ``model_family`` ("llama" / "deepseek") and ``num_layers`` default to the target's config.json under
    the server's ``model_path`` when that is readable here.
    """
    if info.get("engine") == REFERENCE_ENGINE_NAME:
        if info.get("enable_return_aux_hidden_states"):
            raw_ids = info.get("return_aux_hidden_state_layer_ids") or []
            ref_ids = tuple(k if k == "final" else int(k) for k in raw_ids)
            return ServerLayers(ref_ids, "reference", ref_ids,
                                "reference engine aux mode: ids are entering-layer-k already")
        if info.get("enable_return_hidden_states"):
            return ServerLayers(("final",), "final", None, "reference engine: final-norm output")
        raise AlignmentSetupError(
            "the reference engine was started without hidden-state support: add "
            "--enable-return-hidden-states (final-norm output) or --enable-return-aux-hidden-states "
            "[--return-aux-hidden-state-layer-ids ...]")
    version = str(info.get("version", "?"))
    if info.get("enable_return_aux_hidden_states"):
        method = str(info.get("aux_hidden_state_capture") or "eagle3").lower()
        if method != "eagle3":
            raise AlignmentSetupError(f"SGLang aux capture for {method.upper()} uses another layer "
                                      "convention (set_dflash_layers_to_capture); only the EAGLE3 convention "
                                      "is mapped here")
        return _sglang_ids_to_layers(info.get("return_aux_hidden_state_layer_ids"), info, model_family, num_layers,
                                     f"SGLang {version} aux mode, ids")
    mode = info.get("return_hidden_states_mode")
    if not (info.get("enable_return_hidden_states") or mode == "full"):
        last = mode == "last"
        hint = "--return-hidden-states-mode last returns only the last token's row; " if last else ""
        raise AlignmentSetupError(
            f"SGLang {version} was started without full hidden-state support: {hint}add "
            "--enable-return-hidden-states (final-norm output; while serving EAGLE-3, the drafter's aux "
            "layers), or on SGLang 0.5.23 --enable-return-aux-hidden-states --speculative-algorithm EAGLE3 "
            "[--return-aux-hidden-state-layer-ids ...]")
    alg = str(info.get("speculative_algorithm") or "").upper()
    if alg in ("", "NONE"):
        return ServerLayers(("final",), "final", None, f"SGLang {version}: final-norm output")
    if alg != "EAGLE3":
        raise AlignmentSetupError(f"SGLang serving --speculative-algorithm {alg}: which hidden states "
                                  "return_hidden_states stores then is not mapped here; serve without it")
    if draft_config is None:
        dp = info.get("speculative_draft_model_path")
        draft_config = _read_json(Path(str(dp)) / "config.json") if dp else None
        if draft_config is None:
            raise AlignmentSetupError(
                f"SGLang {version} serves EAGLE-3, so return_hidden_states returns the drafter's aux layers, "
                f"whose ids are in its config.json ({dp!r} is not readable here): pass draft_config")
    eagle = draft_config.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state", True) is False:
        # spec_aux_hidden_state.py _resolve_eagle_aux_hidden_state: no aux capture, so the final state stays
        return ServerLayers(("final",), "final", None, f"SGLang {version} serving EAGLE-3 without aux states")
    return _sglang_ids_to_layers(eagle.get("eagle_aux_hidden_state_layer_ids"), info, model_family, num_layers,
                                 f"SGLang {version} serving EAGLE-3: packed aux rows for drafter ids")


def _sglang_ids_to_layers(raw: Any, info: dict[str, Any], model_family: str | None, num_layers: int | None,
                          what: str) -> ServerLayers:
    """SGLang aux ids (``raw``; None = its default [2, N//2, N-3]) named in the suite's convention by the
    model family's rule; ``what`` opens the provenance line."""
    ids = None if raw is None else [int(k) for k in raw]
    conv = _sglang_convention(info, model_family)
    layers = _served(ids, conv, _num_layers(info, num_layers))
    return ServerLayers(layers, conv, None if ids is None else tuple(ids),
                        f"{what} {ids if ids is not None else 'default'} -> entering layers {list(layers)} ({conv})")


def _server_layers(info: dict[str, Any], **kw: Any) -> list[Layer]:
    return list(server_layers(info, **kw).layers)


def server_hidden_states(base_url: str, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                         hidden: int, concurrent: bool = True, model_family: str | None = None,
                         num_layers: int | None = None, draft_config: dict[str, Any] | None = None
                         ) -> list[HiddenStates]:
    """Generate greedily and return each request's inference-path hidden states (prompt + output[:-1]).

    ``concurrent``: send all prompts at once so the engine batches them (the serving condition);
    otherwise one at a time. ``model_family``, ``num_layers``, ``draft_config``: see :func:`server_layers`.
    """
    info = server_info(base_url)
    plan = server_layers(info, model_family=model_family, num_layers=num_layers, draft_config=draft_config)
    layers = list(plan.layers)
    version = f"{info.get('engine', 'sglang')} {info.get('version')}"
    dtype = str(info.get("dtype", "?"))

    async def one(session: Any, ids: Sequence[int]) -> dict[str, Any]:
        body = {"input_ids": list(ids), "return_hidden_states": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
        async with session.post(base_url.rstrip("/") + "/generate", json=body) as r:
            text = await r.text()
            if r.status != 200:
                raise AlignmentSetupError(f"/generate with return_hidden_states: HTTP {r.status}: {text[:300]}")
            return json.loads(text)

    async def run() -> list[dict[str, Any]]:
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
            if concurrent:
                return list(await asyncio.gather(*(one(s, p) for p in prompts)))
            return [await one(s, p) for p in prompts]

    # A speculative server verifies several tokens per step and stores a row per accepted one; a step
    # that overshoots max_new_tokens may leave rows for tokens the response then cut off. Those rows lie
    # past the returned sequence, after every covered position, so they are dropped (and counted);
    # fewer rows than positions stays an error.
    speculative = str(info.get("speculative_algorithm") or "").upper() not in ("", "NONE")
    out = []
    for ids, res in zip(prompts, asyncio.run(run())):
        meta = res["meta_info"]
        if "hidden_states" not in meta:
            raise AlignmentSetupError("response has no meta_info.hidden_states although the server advertises them")
        parts = parse_sglang_hidden_states(meta["hidden_states"], layers, hidden)
        output = list(res["output_ids"])
        covered = list(ids) + output[:-1]
        n = next(iter(parts.values())).shape[0]
        trimmed = ""
        if speculative and n > len(covered):
            parts = {k: v[: len(covered)] for k, v in parts.items()}
            trimmed = f"; {n - len(covered)} trailing row(s) past the returned tokens dropped"
        elif n != len(covered):
            raise AlignmentSetupError(f"server returned {n} hidden-state rows for {len(covered)} positions "
                                      "(prompt + output[:-1]): radix-cache hit or chunked prefill? (SGLang: "
                                      "--disable-radix-cache --chunked-prefill-size -1)")
        out.append(HiddenStates(parts, tuple(covered), Provenance(
            "server-inference", version, dtype, (0, len(covered)),
            note="prefill block + incremental decode with KV cache" + (", batched" if concurrent else "")
            + f"; {plan.how}{trimmed}"),
            output_ids=tuple(output), prompt_len=len(ids)))
    return out
