"""The pieces behind the hidden-state alignment fixtures: extractors, an aux-mode inference server per dtype, prompts,
the per-layer noise floor the thresholds are calibrated from, and the captures of the other engines'
serving paths (SGLang, vLLM).

Everything is lazy and cached per session, so ``pytest perf_tests/test_alignment.py -k <one test>``
starts only the one server and the one transformers model it needs. Engine captures are cached by
server config: SGLang's are taken from the EAGLE-3 A/B's servers while they run
(:meth:`AlignmentContext.prefetch`), vLLM's extract_hidden_states server is started once for every test
that reads it (:meth:`AlignmentContext.vllm_capture`), because each launch of those engines costs
minutes of GPU time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kimi_perf.baselines import BaselineStore
from kimi_perf.progress import log
from kimi_perf.sections import AlignmentSection
from kimi_perf.session import ServerSettings

from .models import TargetModel
from .servers import ServerPool, engine_config

FALLBACK_PROMPTS = ["Why is the sky blue?", "Write a haiku about the sea.", "List three prime numbers and explain."]


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@dataclass(frozen=True)
class AlignmentSettings:
    dtypes: tuple[str, ...]
    prompts: int
    max_new_tokens: int
    margin: float
    min_gap: float
    norm_tol_min: float
    layers: tuple[Any, ...]  # the layers under test: EAGLE-3 aux layers, N (pre-norm last), "final"
    served: tuple[Any, ...]  # what the server returns (the tested layers and their neighbours)
    num_layers: int
    hidden: int
    aux: tuple[int, ...] = ()  # the drafter's aux layers ("entering layer k"): --perf-drafter's, else default
    # alignment.engines / .engine_noise_factor; the defaults are the section's (kimi_perf.sections)
    engines: tuple[str, ...] = AlignmentSection.engines
    engine_noise_factor: float = AlignmentSection.engine_noise_factor
    architectures: tuple[str, ...] = ()  # the target's config.json architectures (SGLang's id rule)


def build_alignment_settings(a: AlignmentSection, target: TargetModel, drafter_path: str | None = None
                             ) -> AlignmentSettings:
    """The profile's ``alignment`` section ``a`` for ``target``: the layers under test (the drafter's aux
    layers, the last one pre-norm, the final output) and the ones the server must return.
    ``drafter_path`` is ``--perf-drafter`` (its aux layers are the ones under test)."""
    from kimi_perf.alignment.plan import drafter_aux_layers

    cfg = json.loads((target.path / "config.json").read_text())
    n, h = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    eagle: tuple[int, ...] = (2, n // 2, n - 3)
    if drafter_path:
        # the layers the served drafter consumes are the ones worth checking (the CPU recipe's are the
        # default; a drafter trained on others names them in its kimi_perf block)
        from kimi_perf.eagle3.shipped import ShippedDrafterError, checkpoint_dir

        try:
            dc = json.loads((checkpoint_dir(drafter_path) / "config.json").read_text())
            eagle = drafter_aux_layers(dc, n)
        except (OSError, ValueError, ShippedDrafterError) as ex:
            raise pytest.UsageError(f"--perf-drafter {drafter_path}: {ex}") from None
    served = sorted({k + d for k in eagle for d in (-1, 0, 1)} | {n - 1, n})
    return AlignmentSettings(
        dtypes=a.dtypes, prompts=a.prompts, max_new_tokens=a.max_new_tokens, margin=a.margin, min_gap=a.min_gap,
        norm_tol_min=a.norm_tol_min, layers=(*eagle, n, "final"), served=(*served, "final"), num_layers=n, hidden=h,
        aux=tuple(eagle), engines=a.engines, engine_noise_factor=a.engine_noise_factor,
        architectures=tuple(cfg.get("architectures") or ()))


@dataclass(frozen=True)
class EngineCapture:
    """One engine server's hidden states for the alignment prompts, and how its columns were named."""

    states: list[Any]  # HiddenStates per prompt (suite convention: "entering layer k", "final")
    layers: tuple[Any, ...]  # the layers the columns are
    server_ids: tuple[Any, ...] | None  # the ids as the engine/drafter names them (None: its default)
    convention: str  # "reference", "sglang-llama", "vllm", "final", ...
    how: str  # one line: how the ids were mapped (provenance)
    config_name: str
    version: str | None
    # vLLM: the decode-path capture (include_output_tokens) of the same positions, for the decode-path
    # check; the states above are the prefill capture (the upstream way)
    decode_path: tuple[Any, ...] = ()


def wants_capture(session: pytest.Session, argname: str, engine: str) -> bool:
    """Whether a selected test of this session will read ``engine``'s capture (its ``argname``
    parameter is ``engine``): the EAGLE-3 A/B captures for it only then."""
    for item in session.items:
        cs = getattr(item, "callspec", None)
        if cs is not None and cs.params.get(argname) == engine:
            return True
    return False


class AlignmentContext:
    """Per-session cache of the expensive pieces, created on first use. Besides the model, the pool and
    the settings it reads the engine settings (``servers``) and, for stored noise floors, the baseline
    ``store`` and the ``hardware`` key."""

    def __init__(self, target: TargetModel, pool: ServerPool, st: AlignmentSettings, *, servers: ServerSettings,
                 store: BaselineStore, hardware: str) -> None:
        self.target, self.pool, self.st = target, pool, st
        self.servers, self.store, self.hardware = servers, store, hardware
        self._hf: dict[str, Any] = {}
        self._inf: dict[str, Any] = {}
        self._floor: dict[str, Any] = {}
        self._prompts: list[list[int]] | None = None
        self._captures: dict[Any, EngineCapture] = {}
        self._capture_errors: dict[Any, str] = {}
        self._extract_dirs: dict[tuple[str, tuple[int, ...]], str] = {}

    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.target.path))

    def prompts(self) -> list[list[int]]:
        if self._prompts is None:
            from kimi_perf.data import chat_prompt_ids, load_mtbench, stable_split

            tok = self.tokenizer()
            try:
                texts = [c.turns[0] for c in load_mtbench() if stable_split(c.id, 0.25) == "heldout"]
            except FileNotFoundError:
                texts = FALLBACK_PROMPTS
            self._prompts = [chat_prompt_ids(tok, [t]) for t in texts[: self.st.prompts]]
        return self._prompts

    def hf(self, dtype: str) -> Any:
        if dtype not in self._hf:
            from kimi_perf.alignment.extract import HFExtractor

            log(f"alignment: loading transformers {self.target.name} ({dtype})")
            self._hf[dtype] = HFExtractor(self.target.path, dtype=dtype)
        return self._hf[dtype]

    def server_config(self, dtype: str) -> Any:
        return engine_config(self.servers, "reference", self.target, dtype=dtype, aux_hidden_states=True,
                             aux_layer_ids=tuple(self.st.served), max_running_requests=8)

    def server(self, dtype: str) -> Any:
        return self.pool.get(self.server_config(dtype))

    def inference(self, dtype: str) -> list[Any]:
        """Greedy generation for all prompts at once (batched), hidden states of the serving path."""
        if dtype not in self._inf:
            from kimi_perf.alignment.extract import server_hidden_states

            srv = self.server(dtype)
            self._inf[dtype] = server_hidden_states(srv.base_url, self.prompts(), self.st.max_new_tokens,
                                                    hidden=self.st.hidden, concurrent=True)
        return self._inf[dtype]

    def noise_floor(self, dtype: str) -> dict[Any, dict[str, float]]:
        """Same backend, same tokens, different serving conditions: alone vs batched with the other
        prompts, and prefill of the whole sequence vs incremental decode; for a reduced-precision dtype
        also the same engine in fp32, and the transformers extractor in fp32 vs this dtype (two correct
        bf16 implementations may each sit that far from the fp32 result, so they can disagree by about
        that much). Worst case per layer."""
        if dtype not in self._floor:
            from kimi_perf.alignment.compare import compare_layer
            from kimi_perf.alignment.extract import server_hidden_states

            srv = self.server(dtype)
            batched_all = self.inference(dtype)
            alone_all = server_hidden_states(srv.base_url, self.prompts(), self.st.max_new_tokens,
                                             hidden=self.st.hidden, concurrent=False)
            seqs = [list(b.token_ids) for b in batched_all]
            prefill_all = server_hidden_states(srv.base_url, seqs, 1, hidden=self.st.hidden, concurrent=False)
            ref32_all = None
            if dtype != "float32":
                ref32_all = server_hidden_states(self.server("float32").base_url, seqs, 1, hidden=self.st.hidden,
                                                 concurrent=False)
            hf_lo = hf_hi = []
            if dtype != "float32":
                layers = list(self.st.layers)
                hf_lo = [self.hf(dtype).hidden_states(q, layers) for q in seqs]
                hf_hi = [self.hf("float32").hidden_states(q, layers) for q in seqs]
            out: dict[Any, dict[str, float]] = {}
            for k in self.st.layers:
                cs = []
                for i, batched in enumerate(batched_all):
                    n = len(batched.token_ids)
                    # greedy decoding alone and in a batch may diverge in reduced precision: only the
                    # common prefix holds the same tokens on both sides
                    m = common_prefix(alone_all[i].token_ids, batched.token_ids)
                    cs.append(compare_layer(alone_all[i].layers[k][:m], batched.layers[k][:m], layer=str(k)))
                    cs.append(compare_layer(prefill_all[i].layers[k][:n], batched.layers[k], layer=str(k)))
                    if ref32_all is not None:
                        cs.append(compare_layer(ref32_all[i].layers[k][:n], batched.layers[k], layer=str(k)))
                        cs.append(compare_layer(hf_lo[i].layers[k], hf_hi[i].layers[k], layer=str(k)))
                out[k] = {"cosine_min": min(c.cos_min for c in cs), "cosine_p1": min(c.cos_p1 for c in cs),
                          "cosine_mean": min(c.cos_mean for c in cs),
                          "norm_dev": max(abs(c.norm_ratio_median - 1.0) for c in cs),
                          "rel_l2_max": max(c.rel_l2_max for c in cs)}
            self._floor[dtype] = out
        return self._floor[dtype]

    # -- other engines' serving paths -------------------------------------------------------------

    def capture(self, cfg: Any, srv: Any = None, *, stop: bool = True) -> EngineCapture:
        """An SGLang-layout server's hidden states (``/generate`` with ``return_hidden_states``) for the
        alignment prompts, greedy, all prompts at once (batched, the serving condition); columns named
        by :func:`kimi_perf.alignment.extract.server_layers` (SGLang's layer-id rule applied). Cached by
        config. ``srv``: a running server of ``cfg`` (else the pool's, launched if needed; ``stop``
        then stops it afterwards)."""
        if cfg in self._captures:
            return self._captures[cfg]
        if cfg in self._capture_errors:
            raise AssertionError(f"{cfg.name}: the hidden-state capture failed earlier in this session: "
                                 f"{self._capture_errors[cfg]}")
        from kimi_perf.alignment.extract import server_hidden_states, server_info, server_layers

        launched = srv is None
        if srv is None:
            srv = self.pool.get(cfg)
        try:
            plan = server_layers(server_info(srv.base_url), num_layers=self.st.num_layers)
            states = server_hidden_states(srv.base_url, self.prompts(), self.st.max_new_tokens, hidden=self.st.hidden,
                                          concurrent=True, num_layers=self.st.num_layers)
        except Exception as e:
            self._capture_errors[cfg] = f"{type(e).__name__}: {e}"
            raise
        finally:
            if launched and stop:
                self.pool.stop(cfg)
        cap = EngineCapture(states, plan.layers, plan.server_ids, plan.convention, plan.how, cfg.name, srv.version)
        log(f"alignment: captured {cfg.name} ({plan.how}) for {len(states)} prompts")
        self._captures[cfg] = cap
        return cap

    def prefetch(self, servers: Mapping[str, Any]) -> None:
        """Capture from running servers that return hidden states (the EAGLE-3 A/B's SGLang servers,
        before they are stopped). A failure is kept for the alignment test to report: it must not fail
        the acceptance test that happened to host the capture."""
        for srv in servers.values():
            cfg = srv.config
            if getattr(cfg, "return_hidden_states", False) and cfg not in self._captures:
                try:
                    self.capture(cfg, srv, stop=False)
                except Exception as e:  # noqa: BLE001 - recorded in _capture_errors, re-raised by capture()
                    log(f"alignment: capture from {cfg.name} failed ({type(e).__name__}: {e}); the alignment "
                        "test will report it")

    def vllm_config(self, engine: str, layers: tuple[int, ...]) -> Any:
        """vLLM's extract_hidden_states server for ``layers``, one config per (engine, layers) in this
        session (the connector's output directory is part of the config, so it is created once)."""
        import tempfile

        key = (engine, tuple(layers))
        if key not in self._extract_dirs:
            self._extract_dirs[key] = tempfile.mkdtemp(prefix="kimi-perf-vllm-hs-")
        return engine_config(self.servers, engine, self.target, extract_hidden_layers=tuple(layers),
                             extract_dir=self._extract_dirs[key])

    def vllm_capture(self, engine: str, layers: tuple[int, ...]) -> EngineCapture:
        """vLLM's hidden states at ``layers`` (its ids are "entering layer k" already; the last layer is
        pre-final-norm) for the alignment prompts; the server runs only for the capture."""
        return self.vllm_capture_config(self.vllm_config(engine, layers), layers)

    def vllm_capture_config(self, cfg: Any, layers: tuple[int, ...]) -> EngineCapture:
        """:meth:`vllm_capture` for a given extract_hidden_states config (an A/B side's), cached by it."""
        if cfg in self._captures:
            return self._captures[cfg]
        from kimi_perf.alignment.extract import vllm_hidden_states

        srv = self.pool.get(cfg)
        decode: list[Any] = []
        try:
            states = vllm_hidden_states(srv.base_url, srv.model, self.prompts(), self.st.max_new_tokens,
                                        layers=list(layers), decode=decode)
        finally:
            self.pool.stop(cfg)
        how = (f"vLLM {srv.version} extract_hidden_states, prompt + generated ids prefilled with max_tokens=1 "
               f"(upstream usage), ids {list(layers)} = entering layers {list(layers)} (vLLM's convention is the "
               "suite's; its last layer is pre-final-norm)")
        cap = EngineCapture(states, tuple(layers), tuple(layers), "vllm", how, cfg.name, srv.version, tuple(decode))
        self._captures[cfg] = cap
        return cap

    def engine_threshold(self, engine: str, dtype: str, layer: Any) -> tuple[float, float, str]:
        """:meth:`threshold` for ``engine``: the reference engine's, or for another engine that
        threshold with its cosine distance and norm tolerance ``alignment.engine_noise_factor`` times
        wider (kimi_perf.alignment.plan.ENGINE_NOISE_FACTOR says why)."""
        from kimi_perf.alignment.plan import engine_threshold

        thr, tol, src = self.threshold(dtype, layer)
        kind = str(self.servers.engines[engine]["kind"])
        t2, tol2 = engine_threshold(thr, tol, kind, self.st.engine_noise_factor)
        if kind != "reference":
            src = (f"{src}, cosine distance and norm tolerance x{self.st.engine_noise_factor:g} for another "
                   "engine's bf16 kernels (alignment.engine_noise_factor)")
        return t2, tol2, src

    def threshold(self, dtype: str, layer: Any) -> tuple[float, float, str]:
        """(cosine threshold, norm-ratio tolerance, where the floor came from) for one layer: the
        stored baseline noise floor for this profile and dtype if there is one, else this run's."""
        from kimi_perf.alignment.compare import threshold_from_floor
        from kimi_perf.baselines import BaselineKey

        key = BaselineKey(scenario="alignment_noise_floor", engine="reference", model=self.target.name,
                          hardware=self.hardware, workload=f"{dtype}:layer-{layer}", concurrency=1)
        stored = self.store.lookup_samples(key, "cosine_min")
        if stored:
            floor, src = float(np.min(stored)), f"stored noise floor {self.store.path.name}"
        else:
            floor, src = self.noise_floor(dtype)[layer]["cosine_min"], "noise floor measured in this run"
        dev = self.noise_floor(dtype)[layer]["norm_dev"] if not stored else 0.0
        thr = threshold_from_floor(floor, self.st.margin, self.st.min_gap)
        return thr, max(self.st.margin * dev, self.st.norm_tol_min), src


