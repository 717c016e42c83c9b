"""The extraction-path x serving-engine matrix, measured (kimi_perf.eagle3.matrix decides and draws).

Why one per-session object (the ``extraction_matrix`` fixture): a row's drafter costs minutes to train (features + training on the CPU box,
~3.5 min each) and a serving engine's inference capture a server launch; the reduced matrix CI runs and
the full one under ``-m matrix`` share them, and the pipeline's cache shares them across sessions (a
second run only re-serves). Everything but the extraction path is held fixed: the rows' drafters use
the profile's ``eagle3.recipe`` with only ``features`` changed, so they train on the same regenerated
samples with the same seed and vocabulary; a row whose feature spec is the recipe's own is the
session's drafter (``eagle3_drafter``, shipped or trained) and is not trained again, unless the session
serves ``eagle3.serve``'s bundle (another recipe): then it is the recipe's own, shipped or trained.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kimi_perf.progress import log
from kimi_perf.session import Eagle3Settings

from .alignment import AlignmentContext
from .drafters import DrafterHandle, Eagle3Runs, measure_once, require_engine, spec_engine_config
from .models import TargetModel
from .servers import ServerPool, engine_config


class ExtractionMatrix:
    """Per-session cache of the matrix's pieces: row drafters, engine captures, cosines, acceptance."""

    def __init__(self, s: Eagle3Settings, target: TargetModel, pool: ServerPool, alignment: AlignmentContext,
                 drafter: DrafterHandle, runs: Eagle3Runs) -> None:
        e = s.eagle3
        if e is None or e.matrix is None:
            pytest.skip(f"profile {s.servers.profile_name} has no eagle3.matrix section")
        self.plan = e.matrix  # validated when the profile loaded
        # below this the own-features drafter cannot resolve an acceptance drop (the layer-mismatch test's bound)
        self.resolvable = e.eval.mismatch_min_accept_length
        try:
            self.recipe = e.drafter_recipe()
        except (TypeError, ValueError) as ex:
            raise pytest.UsageError(f"profile {s.servers.profile_path}: eagle3.recipe (the matrix trains its row drafters "
                                    f"with it): {ex}") from None
        self.s, self.target, self.pool, self.al, self.drafter, self.runs = s, target, pool, alignment, drafter, runs
        self.layers = tuple(alignment.st.aux)
        self._drafters: dict[str, Path] = {}
        self._reports: dict[str, dict[str, Any]] = {}
        self._inference: dict[str, list[Any]] = {}
        self._cos: dict[tuple[str, str], tuple[Any, ...]] = {}
        self._accept: dict[tuple[str, str], Any] = {}

    # -- pieces ----------------------------------------------------------------------------------

    def kind(self, engine: str) -> str:
        return str(self.s.servers.engines[engine]["kind"])

    def engine_of_kind(self, kind: str) -> str:
        for name, raw in self.s.servers.engines.items():
            if raw.get("kind") == kind:
                return name
        raise pytest.UsageError(f"profile {self.s.servers.profile_path}: the matrix extracts through {kind}, which no engine "
                                "of the profile is")

    def spec(self, row: Any, server: Any = None) -> Any:
        return row.features_of(self.recipe.features, server_url=server.base_url if server else None,
                               server_model=server.model if server else None)

    def inference(self, engine: str) -> list[Any]:
        """``engine``'s hidden states at the drafter's aux layers while generating the alignment prompts
        (the serving condition: batched greedy decode), suite convention (entering layer k)."""
        if engine not in self._inference:
            kind = self.kind(engine)
            require_engine(self.s, engine)
            if kind == "reference":
                self._inference[engine] = self.al.inference(self.recipe.features.dtype)
            elif kind == "vllm":
                self._inference[engine] = self.al.vllm_capture(engine, self.layers).states
            elif kind == "sglang":
                self._inference[engine] = self._sglang_inference(engine)
            else:
                pytest.skip(f"the matrix has no inference capture for engine kind {kind!r} (reference, vllm, sglang)")
        return self._inference[engine]

    def _sglang_hs_config(self, engine: str) -> Any:
        """The session drafter's SGLang speculative server with return_hidden_states: the A/B's when it
        already returns them, else its twin with the flag."""
        spec = self.runs.configs(engine)["spec"]
        if getattr(spec, "return_hidden_states", False):
            return spec
        return spec_engine_config(self.s, self.target, self.drafter.path, self.drafter.steps, engine=engine,
                                  tag="spec-hs", return_hidden_states=True)

    def _sglang_inference(self, engine: str) -> list[Any]:
        """SGLang's serving-path aux states: the session drafter's speculative server with
        ``return_hidden_states`` returns the rows its EAGLE-3 capture packs for the drafter (sglang 0.5.17
        has no aux-only mode), the same capture test_engine_alignment compares with transformers. The A/B's
        speculative server is reused when it already returns hidden states."""
        cap = self.al.capture(self._sglang_hs_config(engine))
        missing = [k for k in self.layers if k not in cap.layers]
        if missing:
            pytest.fail(f"{engine}: the speculative server returned layers {list(cap.layers)} ({cap.how}), not the "
                        f"drafter's aux layers {list(self.layers)}: see test_engine_alignment for the id rule",
                        pytrace=False)
        return list(cap.states)

    def _cosines(self, row: Any, path: Any, engines: tuple[str, ...]) -> None:
        """The row's path run on each engine's own sequences, per layer, worst token over all prompts."""
        from kimi_perf.alignment.compare import compare_layer
        from kimi_perf.eagle3.matrix import LayerAgreement

        for engine in engines:
            if (row.name, engine) in self._cos:
                continue
            dtype = self.recipe.features.dtype
            worst = {k: 1.0 for k in self.layers}
            for hs in self.inference(engine):
                n = min(len(hs.token_ids), *(hs.get(k).shape[0] for k in self.layers))
                feats = path.by_layer(list(hs.token_ids[:n]))
                for k in self.layers:
                    c = compare_layer(feats[k][:n].cpu().numpy(), hs.get(k)[:n], layer=str(k))  # on cuda under a GPU recipe
                    worst[k] = min(worst[k], c.cos_min)
            # engine_threshold: the reference engine's own threshold for it, x engine_noise_factor for others
            self._cos[(row.name, engine)] = tuple(
                LayerAgreement(k, worst[k], self.al.engine_threshold(engine, dtype, k)[0]) for k in self.layers)

    @contextmanager
    def _row_server(self, row: Any) -> Iterator[Any]:
        """The server a row extracts through, up for the block and stopped after it: vLLM's
        extract_hidden_states for a vLLM row, the session drafter's SGLang server with
        return_hidden_states for an SGLang row; None for rows that extract in-process."""
        if row.base not in ("vllm", "sglang"):
            yield None
            return
        from kimi_perf.eagle3.features import feature_layers

        eng = self.engine_of_kind(row.base)
        require_engine(self.s, eng)
        if row.base == "vllm":
            _, captured = feature_layers(self.spec(row), self.al.st.num_layers)
            cfg = self.al.vllm_config(eng, captured)
        else:  # MatrixPlan refuses sglang+offsetK: SGLang returns the served drafter's layers only
            cfg = self._sglang_hs_config(eng)
        try:
            yield self.pool.get(cfg)
        finally:
            self.pool.stop(cfg)

    def prepare(self, row: Any, engines: tuple[str, ...]) -> None:
        """The row's drafter (trained unless cached or the session's) and its cosines vs ``engines``.
        A vLLM row needs an extract_hidden_states server for both; it runs only for them."""
        from kimi_perf.eagle3.features import FeaturePath

        if row.name in self._drafters and all((row.name, e) in self._cos for e in engines):
            return
        for e in engines:
            self.inference(e)  # captured before the row's own server runs: one server at a time on 2 cores
        with self._row_server(row) as server:
            spec = self.spec(row, server)
            if row.name not in self._drafters:
                self._drafters[row.name] = self._build(row, spec)
            t0 = time.monotonic()
            self._cosines(row, FeaturePath(spec, self.target.path, max_len=self.recipe.train.max_seq_len), engines)
            log(f"matrix: {row.name} cosines vs {', '.join(engines)} in {time.monotonic() - t0:.0f}s: "
                + "; ".join(f"{e}: " + ", ".join(f"L{a.layer} {a.cos_min:.4f}" for a in self._cos[(row.name, e)])
                            for e in engines))

    def _build(self, row: Any, spec: Any, seed: int | None = None) -> Path:
        """The drafter of ``row`` through the cached pipeline: the recipe with only the feature path (and,
        for the retraining-noise test, the training seed) changed."""
        from kimi_perf.eagle3.pipeline import build_drafter

        train = self.recipe.train if seed is None else replace(self.recipe.train, seed=seed)
        # a session that serves eagle3.serve's bundle (another recipe) has no drafter of this recipe to
        # lend: the row gets the recipe's own (shipped or trained), or the matrix would compare recipes
        # instead of feature paths (it did once: hf -> reference 1.782 against the reference row's 1.287)
        if spec.digest() == self.recipe.features.digest() and train == self.recipe.train and not self.drafter.served:
            log(f"matrix: row {row.name} uses the session's drafter ({self.drafter.path})")
            self._reports[row.name] = self.drafter.report
            return self.drafter.path
        recipe = replace(self.recipe, features=spec, train=train)
        if seed is None:  # --perf-train-drafter retrains the session's drafter, not the rows' (_shipped says why)
            shipped = self._shipped(row, recipe)
            if shipped is not None:
                return shipped
        from transformers import AutoTokenizer

        log(f"matrix: training the drafter of row {row.name} ({row.describe()})"
            + (f", training seed {seed}" if seed is not None else "")
            + "; same samples and recipe as the session's drafter, only the feature path"
            + (" and the seed differ" if seed is not None else " differs"))
        gen_cfg = engine_config(self.s.servers, "reference", self.target,
                                max_running_requests=max(self.recipe.data.concurrency, 1))
        art = build_drafter(recipe, self.target.path,
                            self.target.fingerprint, gen_url=lambda: self.pool.get(gen_cfg).base_url,
                            tokenizer=AutoTokenizer.from_pretrained(str(self.target.path)))
        self.pool.stop(gen_cfg)
        if seed is None:
            self._reports[row.name] = art.report
        return art.path

    def _shipped(self, row: Any, recipe: Any) -> Path | None:
        """A row drafter shipped in the package (kimi_perf.eagle3.shipped), as the session's drafter is:
        the reduced matrix's reference row costs ~6.5 minutes to train on the 2-core box (regenerating the
        recipe's samples, capturing features through the reference engine, training), more than the rest
        of the main job's EAGLE-3 work. Trusted only for this recipe and target.

        Served under ``--perf-train-drafter`` too. CI passes that flag so that data, capture and training
        stay tested on every merge, and the session's drafter covers them; the row's own capture path is
        measured by its cosines either way. Retraining the row as well cost CI 470 s of its 50 minutes
        (2026-12-05, 2-core AMD box) and tested no code the session's drafter does not. A row whose
        recipe changed has no matching bundle and trains, which is when a re-export is due."""
        from kimi_perf.eagle3.shipped import ShippedDrafterError, find_shipped, install

        try:
            bundle, why = find_shipped(recipe, self.target.fingerprint)
        except ShippedDrafterError as ex:
            pytest.fail(f"matrix row {row.name}: {ex}", pytrace=False)
        if bundle is None:
            log(f"matrix: row {row.name}: {why}")
            return None
        log(f"matrix: row {row.name} serves the {why}")
        art = install(bundle, recipe, self.target.path, self.target.fingerprint, heldout_features=False)
        self._reports[row.name] = art.report
        return Path(art.path)

    def accept(self, row: Any, engine: str) -> Any:
        """AcceptanceResult of the row's drafter served by ``engine`` on the held-out prompts."""
        return self._accept_of(engine, self._drafters[row.name], row.name.replace("+", "-"))

    def _accept_of(self, engine: str, path: Path, tag: str) -> Any:
        """One greedy pass of drafter ``path`` on ``engine``, cached by ``tag`` (row name, or row and seed)."""
        key = (tag, engine)
        if key not in self._accept:
            if path == self.drafter.path:
                self._accept[key] = self.runs.accept_length(engine)[0]
            else:
                require_engine(self.s, engine)
                over = {"max_running_requests": 4} if self.kind(engine) == "reference" else {}
                cfg = spec_engine_config(self.s, self.target, path, self.drafter.steps, engine=engine,
                                         tag="matrix-" + tag, **over)
                self._accept[key] = measure_once(self.s, self.pool, cfg, self.drafter.eval_prompts,
                                                 f"matrix-{tag}-{engine}", exclusive=self.kind(engine) != "reference")
            r = self._accept[key]
            log(f"matrix: {tag} served by {engine}: accept length {r.accept_length:.3f}, per position "
                + ", ".join(f"{x:.3f}" for x in r.pos_rates()[:3]))
        return self._accept[key]

    def retrain_noise(self, engine: str) -> Any:
        """``engine``'s own-features drafter trained with ``retrain_seeds`` seeds (the recipe's seed and
        the next ones) on the same samples and features, each served by ``engine``: the spread the
        aligned-path tolerance must cover."""
        from kimi_perf.eagle3.matrix import RetrainNoise, own_row, parse_row

        row = parse_row(own_row(self.kind(engine)))
        self.prepare(row, (engine,))
        base = self.recipe.train.seed
        seeds = tuple(range(base, base + self.plan.retrain_seeds))
        als = []
        t0 = time.monotonic()
        for i, seed in enumerate(seeds):
            log(f"matrix retraining noise: {row.name} on {engine}, seed {seed} ({i + 1}/{len(seeds)}, "
                f"{time.monotonic() - t0:.0f}s in)")
            if seed == base:
                res = self.accept(row, engine)
            else:
                # prepare() built the row's features; the seed changes only training, so no extraction
                # server is needed (its URL is not part of the feature digest)
                path = self._build(row, self.spec(row), seed=seed)
                res = self._accept_of(engine, path, f"{row.name}-seed{seed}")
            als.append(float(res.accept_length))
        return RetrainNoise(engine, row.name, seeds, tuple(als), self.plan.accept_tolerance)

    # -- cells -----------------------------------------------------------------------------------

    def cells(self, rows: tuple[Any, ...], engines: tuple[str, ...]) -> list[Any]:
        from kimi_perf.eagle3.matrix import MatrixCell, judge, own_row

        t0 = time.monotonic()
        for i, row in enumerate(rows):
            log(f"matrix: row {i + 1}/{len(rows)} {row.name} ({time.monotonic() - t0:.0f}s into the matrix)")
            self.prepare(row, engines)
        names = {r.name for r in rows}
        out = []
        for engine in engines:
            own = own_row(self.kind(engine))
            own_al = None
            if own in names:
                own_al = self.accept(next(r for r in rows if r.name == own), engine).accept_length
            for row in rows:
                res = self.accept(row, engine)
                layers = self._cos[(row.name, engine)]
                verdict, reason = judge(row, engine, layers, res.accept_length, own_al,
                                        tolerance=self.plan.accept_tolerance, resolvable=self.resolvable,
                                        own=row.name == own, cosine_only=row.name in self.plan.cosine_only)
                rep = self._reports.get(row.name, {})
                out.append(MatrixCell(row.name, engine, row.planted, layers, res.accept_length,
                                      tuple(res.pos_rates()[:3]), own_al, verdict, reason,
                                      extra={"path": row.describe(), "drafter": str(self._drafters[row.name]),
                                             "train_final_loss": (rep.get("train") or {}).get("final_loss"),
                                             # the trainer's held-out walk on the row's own features: a
                                             # fault a fine-tune adapted to reads high here and low served
                                             "own_path_heldout": _own_heldout(rep),
                                             "feature_backend_version": (rep.get("features") or {}).get("backend_version")}))
        log(f"matrix: {len(rows)} x {len(engines)} cells in {time.monotonic() - t0:.0f}s")
        return out


def _own_heldout(report: dict[str, Any]) -> float | None:
    """The last epoch's held-out chain walk (accept length) of a row's drafter on its own path's
    features, from its build report; None for a drafter built before the trainer recorded it."""
    epochs = (report.get("train") or {}).get("heldout_by_epoch") or []
    chain = epochs[-1].get("chain") if epochs else None
    return float(chain["accept_length"]) if chain else None
