"""The extraction-path x serving-engine matrix: which capture path makes a drafter the engine accepts.

Why: the seed's drafter accepted nothing (accept length 1.0: only the bonus token). Its features came
from a patched vLLM worker, serving was SGLang, and nobody could say whether the two paths disagreed,
by how much, and whether that disagreement was what broke acceptance. Alignment tools compare two
paths' hidden states (SpecForge: ``allclose(atol=0.1)``); none ties that to acceptance. The matrix
does, with everything else held fixed:

- rows: the extraction path of the training features (transformers, the reference engine, vLLM's
  ``extract_hidden_states``, SGLang's EAGLE-3 capture; and planted faults on a good path: one layer
  off, post-norm instead of the residual stream, int8-rounded);
- columns: the serving engine;
- cell: per-layer cosine of the row's features against that engine's inference states (the row's path
  run on the engine's own generated sequences), and the acceptance of the drafter trained on the row's
  features (same samples, same recipe, same seed: only the path differs) served by that engine.

Gates (:func:`judge`), per cell, against the drafter trained on the serving engine's *own* features:

- every layer at or above the alignment threshold -> accept length within ``accept_tolerance``
  (relative) of the own-features drafter's, else FAIL (the cosine gate passed a path that costs
  acceptance: the threshold is too loose);
- a planted fault must fail the cosine gate at some layer (else FAIL: alignment cannot see it) and, when
  the own-features drafter accepts enough to resolve a drop (``resolvable``), must lose more than the
  tolerance; below that the drop is reported, not asserted (INCONCLUSIVE), as the layer-mismatch test does.
  A planted row the profile lists in ``cosine_only`` is a fault measured to cost less acceptance than the
  tolerance (one layer off: -1.2% to -2.6% with a ~2.1 drafter on an H100): the cosine gate alone must
  catch it, and its acceptance drop is reported, not asserted;
- a real path that fails the cosine gate against an engine is itself the finding: FAIL, naming the
  layers (the acceptance it costs is in the cell).

The tolerance is itself measured, not assumed (:class:`RetrainNoise`): the own-features drafter trained
with ``retrain_seeds`` seeds on the same samples must not differ from itself by more than the
tolerance, or the aligned-path gate would fail real paths by chance.

Nothing here imports torch: kimi_perf.suite.matrix measures, this module decides and draws.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["cell_decision", "cell_from_json", "heatmap_states", "MatrixCell", "MatrixPlan", "MatrixRow", "LayerAgreement", "RetrainNoise", "judge",
           "noise_decision", "parse_row", "render_heatmap", "render_markdown"]

# row base name -> (feature backend, the engine kind whose own features it is)
PATHS: dict[str, tuple[str, str]] = {
    "hf": ("hf", "hf"),
    "reference": ("reference", "reference"),
    "vllm": ("vllm-extract", "vllm"),
    # sglang 0.5.17 has no aux-only mode: its EAGLE-3 server's return_hidden_states rows (http-aux backend)
    "sglang": ("http-aux", "sglang"),
}
FAULTS = ("offset", "postnorm", "int8")
_ROW = re.compile(r"(?P<base>[a-z]+)(?:\+(?P<fault>offset(?P<k>-?\d+)|postnorm|int8))?")


@dataclass(frozen=True)
class MatrixRow:
    """One extraction path: a real capture path, optionally with one planted fault."""

    name: str  # e.g. "vllm", "hf+offset1"
    base: str  # hf | reference | vllm
    backend: str  # the FeatureSpec backend
    layer_offset: int = 0
    transform: str = "none"

    @property
    def planted(self) -> bool:
        return self.layer_offset != 0 or self.transform != "none"

    def features_of(self, spec: Any, **more: Any) -> Any:
        """``spec`` (a recipe's FeatureSpec) with this row's extraction path: what the row's drafter is
        trained on and what its shipped bundle is keyed by (``more``: e.g. the capture server's URL)."""
        from dataclasses import replace

        # online features (computed per training batch, never stored) need an in-process target: a row
        # captured through a server stores its rows even when the recipe's own path runs online
        online = spec.online and self.backend in ("hf", "reference")
        return replace(spec, backend=self.backend, layer_offset=self.layer_offset, transform=self.transform,
                       online=online, **more)

    def describe(self) -> str:
        what = {"hf": "transformers forward with pre-hooks", "reference": "reference engine prefill",
                "vllm": "vLLM extract_hidden_states prefill",
                "sglang": "SGLang EAGLE-3 server, return_hidden_states prefill"}[self.base]
        if self.layer_offset:
            what += f", PLANTED: captured {self.layer_offset:+d} layer(s) off, labelled as intended"
        if self.transform == "postnorm":
            what += ", PLANTED: after the layer's input RMSNorm instead of the residual stream"
        if self.transform == "int8":
            what += ", PLANTED: int8-rounded (one absmax scale per layer per sample)"
        return what


def parse_row(name: str) -> MatrixRow:
    m = _ROW.fullmatch(name)
    if m is None or m.group("base") not in PATHS:
        raise ValueError(f"matrix row {name!r}: write PATH or PATH+FAULT with PATH one of {sorted(PATHS)} and FAULT "
                         "offsetK (e.g. offset1), postnorm or int8")
    base = m.group("base")
    fault = m.group("fault") or ""
    offset = int(m.group("k")) if fault.startswith("offset") else 0
    if fault.startswith("offset") and offset == 0:
        raise ValueError(f"matrix row {name!r}: offset0 is no fault; write {base}")
    return MatrixRow(name, base, PATHS[base][0], offset, fault if fault in ("postnorm", "int8") else "none")


@dataclass(frozen=True)
class MatrixPlan:
    """A profile's ``eagle3.matrix`` section."""

    # metadata: each field's one-line doc and its JSON key (kimi_perf.sections.field_docs reads them)
    rows: tuple[MatrixRow, ...] = field(metadata={"doc": "extraction paths, PATH or PATH+FAULT (hf, reference, vllm, "
                                                         "sglang; offsetK, postnorm, int8), one drafter each"})
    engines: tuple[str, ...] = field(metadata={"doc": "serving engines (columns) of the full matrix (-m matrix)"})
    ci_rows: tuple[MatrixRow, ...] = field(metadata={"doc": "rows of the reduced matrix the main job runs",
                                                     "json": "ci.rows", "default_doc": "rows"})
    ci_engines: tuple[str, ...] = field(metadata={"doc": "engines of the reduced matrix", "json": "ci.engines",
                                                  "default_doc": "engines"})
    accept_tolerance: float = field(default=0.08, metadata={
        "doc": "largest relative accept-length drop of a cell against the engine's own-features drafter, in (0, 1)"})
    sources: str = field(default="", metadata={"doc": "where the tolerance was measured (not a profile key)",
                                               "json": None})
    retrain_seeds: int = field(default=3, metadata={
        "doc": "training seeds test_matrix_retrain_noise trains each engine's own-features drafter with, 2-16"})
    cosine_only: tuple[str, ...] = field(default=(), metadata={
        "doc": "planted rows measured to cost less acceptance than the tolerance: the cosine gate alone must "
               "catch them, their acceptance drop is reported (say where it was measured in sources)"})

    @classmethod
    def from_section(cls, raw: Mapping[str, Any], engines: Mapping[str, Any]) -> MatrixPlan:
        """Validated; ValueError names the key and the fix."""
        known = {"rows", "engines", "ci", "accept_tolerance", "retrain_seeds", "cosine_only"}
        bad = set(raw) - known
        if bad:
            raise ValueError(f"unknown key(s) {sorted(bad)}; allowed: {sorted(known)}")

        def rows(v: Any, where: str) -> tuple[MatrixRow, ...]:
            if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
                raise ValueError(f"{where} must be a non-empty list of row names, e.g. [\"hf\", \"hf+offset1\"]")
            out = tuple(parse_row(x) for x in v)
            for r in out:
                if r.base == "sglang" and r.layer_offset:
                    raise ValueError(f"{where}: row {r.name!r}: SGLang returns the served drafter's aux layers "
                                     "only, so it cannot capture a layer offset; plant the offset on hf or reference")
                if r.base not in ("hf", "reference") and r.base not in {str(e.get("kind")) for e in engines.values()}:
                    raise ValueError(f"{where}: row {r.name!r} extracts through {r.base}, which is no engine of "
                                     f"the profile ({sorted(engines)})")
            return out

        def engs(v: Any, where: str) -> tuple[str, ...]:
            if not isinstance(v, list) or not v or any(e not in engines for e in v):
                unknown = [e for e in v if e not in engines] if isinstance(v, list) else []
                raise ValueError(f"{where} must be a non-empty list of the profile's engines {sorted(engines)}"
                                 + (f", not {unknown}" if unknown else f", not {v!r}"))
            return tuple(v)

        r = rows(raw.get("rows"), "rows")
        e = engs(raw.get("engines"), "engines")
        ci = raw.get("ci", {})
        if not isinstance(ci, Mapping) or set(ci) - {"rows", "engines"}:
            raise ValueError("ci must be an object with rows and engines (the reduced matrix CI runs)")
        cr = rows(ci.get("rows", [x.name for x in r]), "ci.rows")
        ce = engs(ci.get("engines", list(e)), "ci.engines")
        tol = raw.get("accept_tolerance", cls.accept_tolerance)
        if not isinstance(tol, (int, float)) or not 0 < tol < 1:
            raise ValueError(f"accept_tolerance {tol!r} must be a fraction in (0, 1), e.g. 0.08")
        seeds = raw.get("retrain_seeds", cls.retrain_seeds)
        if not isinstance(seeds, int) or isinstance(seeds, bool) or not 2 <= seeds <= 16:
            raise ValueError(f"retrain_seeds {seeds!r} must be an integer from 2 to 16 (training seeds of the "
                             "own-features drafter whose spread the tolerance must cover), e.g. 3")
        co = raw.get("cosine_only", [])
        planted = {x.name for x in (*r, *cr) if x.planted}
        if not isinstance(co, list) or any(x not in planted for x in co):
            raise ValueError(f"cosine_only {co!r} must list planted rows of rows or ci.rows ({sorted(planted)}): "
                             "faults whose acceptance drop was measured below accept_tolerance")
        return cls(r, e, cr, ce, float(tol), retrain_seeds=seeds, cosine_only=tuple(co))


def own_row(engine_kind: str) -> str:
    """The row whose features come from ``engine_kind`` itself (the drafter each cell is held against)."""
    for name, (_, kind) in PATHS.items():
        if kind == engine_kind:
            return name
    raise ValueError(f"no extraction path for engine kind {engine_kind!r}: the matrix knows {sorted(PATHS)}")


@dataclass(frozen=True)
class LayerAgreement:
    layer: int
    cos_min: float
    threshold: float

    @property
    def ok(self) -> bool:
        return self.cos_min >= self.threshold


@dataclass(frozen=True)
class MatrixCell:
    row: str
    engine: str
    planted: bool
    layers: tuple[LayerAgreement, ...]
    accept_length: float
    pos_rates: tuple[float, ...]
    own_accept_length: float | None
    verdict: str  # PASS | FAIL | INCONCLUSIVE
    reason: str
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def aligned(self) -> bool:
        return all(a.ok for a in self.layers)

    @property
    def cos_min(self) -> float:
        return min(a.cos_min for a in self.layers)

    def samples(self) -> dict[str, list[float]]:
        """The cell's measured metrics, one sample each (one deterministic decode), for the gate."""
        out = {"accept_length": [self.accept_length], "cosine_min": [self.cos_min]}
        for i, r in enumerate(self.pos_rates):
            out[f"accept_rate_pos{i}"] = [r]
        return out

    def to_json(self) -> dict[str, Any]:
        return {"row": self.row, "engine": self.engine, "planted": self.planted, "aligned": self.aligned,
                "layers": {str(a.layer): {"cosine_min": a.cos_min, "threshold": a.threshold} for a in self.layers},
                "accept_length": self.accept_length, "pos_rates": list(self.pos_rates),
                "own_accept_length": self.own_accept_length, "verdict": self.verdict, "reason": self.reason,
                **dict(self.extra)}


def judge(row: MatrixRow, engine: str, layers: Sequence[LayerAgreement], accept_length: float,
          own_accept_length: float | None, *, tolerance: float, resolvable: float,
          own: bool = False, cosine_only: bool = False) -> tuple[str, str]:
    """(verdict, reason) of one cell; the rules are the module docstring's. ``cosine_only``: the row is
    in the plan's ``cosine_only`` (a planted fault the cosine gate alone must catch)."""
    bad = [a for a in layers if not a.ok]
    cos = ", ".join(f"layer {a.layer} {a.cos_min:.4f} {'<' if not a.ok else '>='} {a.threshold:.4f}" for a in layers)
    if own_accept_length is None:
        rel_txt, drop = "no own-features drafter to compare with", None
    else:
        drop = 1.0 - accept_length / own_accept_length
        rel_txt = (f"accept length {accept_length:.3f} vs {own_accept_length:.3f} for the drafter trained on "
                   f"{engine}'s own features ({-drop:+.1%}, tolerance -{tolerance:.0%})")
    if own:
        if bad:
            return "FAIL", (f"{row.name} is {engine}'s own path yet disagrees with its inference states ({cos}): the "
                            "capture and the serving path of one engine differ")
        return "PASS", f"{engine}'s own features ({cos}); accept length {accept_length:.3f} is the cell's reference"
    if row.planted:
        if not bad:
            return "FAIL", (f"planted fault {row.name} passes the cosine gate at every layer ({cos}): alignment "
                            "cannot see it")
        if cosine_only:
            return "PASS", (f"planted fault seen by the cosine gate ({cos}); {rel_txt}, reported, not asserted "
                            "(eagle3.matrix.cosine_only: measured to cost less than the tolerance)")
        if drop is None:
            return "INCONCLUSIVE", f"planted fault seen by the cosine gate ({cos}); {rel_txt}"
        if own_accept_length is not None and own_accept_length < resolvable:
            return "INCONCLUSIVE", (f"planted fault seen by the cosine gate ({cos}); {rel_txt}; the own-features "
                                    f"drafter's accept length is below {resolvable} (eval.mismatch_min_accept_length), "
                                    "too weak to resolve an acceptance drop, so the drop is reported, not asserted")
        if drop <= tolerance:
            return "FAIL", (f"planted fault seen by the cosine gate ({cos}) but acceptance held: {rel_txt}")
        return "PASS", f"planted fault seen by the cosine gate ({cos}) and in acceptance: {rel_txt}"
    if bad:
        return "FAIL", (f"{row.name} features disagree with {engine}'s inference states at layer(s) "
                        f"{', '.join(str(a.layer) for a in bad)} ({cos}); {rel_txt}")
    if drop is not None and drop > tolerance:
        return "FAIL", (f"{row.name} passes the cosine gate ({cos}) but the drafter trained on it loses acceptance "
                        f"on {engine}: {rel_txt}")
    return "PASS", f"aligned ({cos}); {rel_txt}"


@dataclass(frozen=True)
class RetrainNoise:
    """The spread of one engine's own-features drafter over training seeds: the null distribution of the
    aligned-path gate.

    Two drafters trained on identical features and samples with different seeds differ in acceptance;
    an aligned path's drafter differs from the own-features drafter at least that much, so a tolerance
    inside this spread fails aligned paths by chance. Every ordered seed pair (i, j) is one aligned
    comparison "i against j" as :func:`judge` makes it; its drop is ``1 - AL_i / AL_j``.
    """

    engine: str
    row: str
    seeds: tuple[int, ...]
    accept_lengths: tuple[float, ...]
    tolerance: float

    @property
    def mean(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths)

    @property
    def rel_sd(self) -> float:
        """Sample standard deviation over seeds relative to the mean."""
        n, m = len(self.accept_lengths), self.mean
        if n < 2 or m <= 0:
            return float("nan")
        return (sum((a - m) ** 2 for a in self.accept_lengths) / (n - 1)) ** 0.5 / m

    @property
    def drops(self) -> list[float]:
        a = self.accept_lengths
        return [1.0 - a[i] / a[j] for i in range(len(a)) for j in range(len(a)) if i != j]

    @property
    def max_drop(self) -> float:
        return max(self.drops)

    @property
    def false_fail_observed(self) -> float:
        """Fraction of ordered seed pairs whose drop exceeds the tolerance."""
        d = self.drops
        return sum(x > self.tolerance for x in d) / len(d)

    @property
    def false_fail_normal(self) -> float:
        """P(one aligned comparison fails by chance) if seed-to-seed acceptance is normal with the
        measured spread: the difference of two independent retrains has sd sqrt(2) * rel_sd, and the gate
        fails the lower one by more than the tolerance."""
        sd = self.rel_sd * 2 ** 0.5
        if not sd > 0:
            return 0.0
        from math import erf

        return 0.5 * (1.0 + erf(-self.tolerance / sd / 2 ** 0.5))

    def judge(self, max_false_fail: float = 0.05) -> tuple[str, str]:
        """FAIL when some seed pair already fails the gate (the tolerance is inside retraining noise);
        INCONCLUSIVE when none does but the normal model puts the chance of a false FAIL above
        ``max_false_fail``; PASS otherwise."""
        als = ", ".join(f"seed {s}: {a:.3f}" for s, a in zip(self.seeds, self.accept_lengths))
        what = (f"{self.row} drafter on {self.engine} over {len(self.seeds)} training seeds ({als}): spread "
                f"{self.rel_sd:.1%} of the mean, largest seed-to-seed drop {self.max_drop:.1%}, tolerance "
                f"{self.tolerance:.0%}; {self.false_fail_observed:.0%} of seed pairs exceed it, "
                f"{self.false_fail_normal:.1%} of aligned comparisons would by the normal model")
        if self.max_drop > self.tolerance:
            need = self.max_drop
            return "FAIL", (f"{what}: retraining alone fails the aligned-path gate; raise eagle3.matrix."
                            f"accept_tolerance to at least {need:.2f} or make training steadier (more samples)")
        if self.false_fail_normal > max_false_fail:
            return "INCONCLUSIVE", (f"{what}: no seed pair exceeds the tolerance, but at this spread more than "
                                    f"{max_false_fail:.0%} of aligned comparisons would fail by chance")
        return "PASS", f"{what}: the tolerance covers retraining noise"

    def to_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "row": self.row, "seeds": list(self.seeds),
                "accept_lengths": list(self.accept_lengths), "tolerance": self.tolerance, "rel_sd": self.rel_sd,
                "max_drop": self.max_drop, "false_fail_observed": self.false_fail_observed,
                "false_fail_normal": self.false_fail_normal}


def render_markdown(cells: Sequence[MatrixCell], *, title: str = "EAGLE-3 extraction path x serving engine") -> str:
    """One table: rows = extraction paths, columns = serving engines; each cell min cosine per layer,
    accept length (pos-0 rate) and the verdict; the reasons follow the table."""
    rows = list(dict.fromkeys(c.row for c in cells))
    engines = list(dict.fromkeys(c.engine for c in cells))
    by = {(c.row, c.engine): c for c in cells}
    out = [f"**{title}** (cosine: min over tokens per aux layer vs the engine's inference states; "
           "accept length incl. bonus, pos-0 acceptance in brackets)", "",
           "| extraction path | " + " | ".join(engines) + " |", "|---|" + "---|" * len(engines)]
    for r in rows:
        cols = []
        for e in engines:
            c = by.get((r, e))
            if c is None:
                cols.append("-")
                continue
            cos = " / ".join(f"{a.cos_min:.4f}{'' if a.ok else '✗'}" for a in c.layers)
            pos0 = f" ({c.pos_rates[0]:.3f})" if c.pos_rates else ""
            cols.append(f"cos {cos}; AL {c.accept_length:.3f}{pos0}; **{c.verdict}**")
        out.append(f"| {r} | " + " | ".join(cols) + " |")
    out.append("")
    for c in cells:
        out.append(f"- {c.row} -> {c.engine}: {c.verdict}: {c.reason}")
    out.append("")
    return "\n".join(out)


# cell colours: pass/fail against the cell's own threshold, never a scale over the data's range (a
# failing cosine of 0.84 read green next to its cross when the scale ran from 0.0 to 1.0)
STATE_COLOURS = {"PASS": "#7fc97f", "FAIL": "#f0606a", "INCONCLUSIVE": "#fdc86e", None: "#e0e0e0"}


def _worst_layer(c: MatrixCell) -> LayerAgreement:
    """The layer furthest below (or closest above) its threshold: the one that decides the cosine gate."""
    return min(c.layers, key=lambda a: a.cos_min - a.threshold)


def heatmap_states(cells: Sequence[MatrixCell]) -> tuple[list[str], list[str], list[list[str | None]],
                                                         list[list[str | None]]]:
    """(rows, engines, cosine state, acceptance state) per cell: cosine PASS when every layer is at or
    above its threshold, else FAIL; acceptance = the cell's verdict (PASS/FAIL/INCONCLUSIVE, judged
    against the own-features drafter with the tolerance); None where no cell was measured."""
    rows = list(dict.fromkeys(c.row for c in cells))
    engines = list(dict.fromkeys(c.engine for c in cells))
    by = {(c.row, c.engine): c for c in cells}
    cos = [[None if (r, e) not in by else ("PASS" if by[r, e].aligned else "FAIL") for e in engines] for r in rows]
    acc = [[None if (r, e) not in by else by[r, e].verdict for e in engines] for r in rows]
    return rows, engines, cos, acc


def render_heatmap(cells: Sequence[MatrixCell], path: Path, *, title: str | None = None) -> Path:
    """Two panels, rows = extraction paths, columns = serving engines, each cell coloured by its own
    pass/fail and the numbers written in: the worst aux layer's cosine against that layer's threshold
    (green at or above, red below), and the accept length against the own-features drafter's
    (coloured by the cell verdict: green PASS, red FAIL, amber INCONCLUSIVE). Planted-fault rows are
    labelled as such: their cosine is meant to fail."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch

    rows, engines, cos_state, acc_state = heatmap_states(cells)
    by = {(c.row, c.engine): c for c in cells}
    planted = {c.row for c in cells if c.planted}
    fig, axes = plt.subplots(1, 2, figsize=(4.5 + 3.0 * len(engines) * 2, 1.9 + 0.62 * len(rows)))
    for ax, states, name in ((axes[0], cos_state, "worst aux layer: min cosine vs its threshold"),
                             (axes[1], acc_state, "accept length vs the own-features drafter (verdict)")):
        ax.imshow([[to_rgb(STATE_COLOURS[st]) for st in row] for row in states], aspect="auto")
        ax.set_xticks(range(len(engines)), engines)
        ax.set_yticks(range(len(rows)), [f"{r} (planted fault)" if r in planted else r for r in rows])
        ax.set_xticks([x - 0.5 for x in range(1, len(engines))], minor=True)
        ax.set_yticks([y - 0.5 for y in range(1, len(rows))], minor=True)
        ax.grid(which="minor", color="white", lw=2)
        ax.tick_params(which="minor", length=0)
        ax.set_xlabel("serving engine")
        ax.set_title(name, fontsize=10)
        for i, r in enumerate(rows):
            for j, e in enumerate(engines):
                c = by.get((r, e))
                if c is None:
                    ax.text(j, i, "not measured", ha="center", va="center", fontsize=8, color="grey")
                    continue
                if ax is axes[0]:
                    w = _worst_layer(c)
                    txt = f"layer {w.layer}: {w.cos_min:.4f}\n{'>=' if w.ok else '<'} {w.threshold:.4f} {'ok' if w.ok else '✗'}"
                else:
                    own = "" if c.own_accept_length is None else (
                        f" vs {c.own_accept_length:.3f} ({c.accept_length / c.own_accept_length - 1:+.1%})")
                    txt = f"{c.accept_length:.3f}{own}\n{c.verdict}"
                ax.text(j, i, txt, ha="center", va="center", fontsize=8)
    axes[0].set_ylabel("extraction path of the training features")
    legend = [Patch(color=STATE_COLOURS["PASS"], label="PASS / at or above threshold"),
              Patch(color=STATE_COLOURS["FAIL"], label="FAIL / below threshold"),
              Patch(color=STATE_COLOURS["INCONCLUSIVE"], label="INCONCLUSIVE")]
    fig.legend(handles=legend, loc="lower center", ncol=3, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cell_from_json(d: Mapping[str, Any]) -> MatrixCell:
    """A cell back from :meth:`MatrixCell.to_json` (``eagle3-matrix-*.json``), e.g. to redraw its heatmap."""
    known = {"row", "engine", "planted", "aligned", "layers", "accept_length", "pos_rates", "own_accept_length",
             "verdict", "reason"}
    return MatrixCell(row=d["row"], engine=d["engine"], planted=bool(d["planted"]),
                      layers=tuple(LayerAgreement(int(k), float(v["cosine_min"]), float(v["threshold"]))
                                   for k, v in d["layers"].items()),
                      accept_length=float(d["accept_length"]), pos_rates=tuple(d.get("pos_rates") or ()),
                      own_accept_length=d.get("own_accept_length"), verdict=d["verdict"], reason=d.get("reason", ""),
                      extra={k: v for k, v in d.items() if k not in known})


def cell_decision(cell: MatrixCell, tolerance: float) -> Any:
    """The cell's verdict as a gate decision for every report (terminal, summary.md, run.json): metric
    accept_length against the own-features drafter's, the tolerance and the reason."""
    from ..stats import GateDecision

    base = cell.own_accept_length
    delta = None if base is None else cell.accept_length / base - 1.0
    return GateDecision(metric="accept_length", unit="tok/step", direction="higher", verdict=cell.verdict,  # type: ignore[arg-type]
                        baseline=base, current=cell.accept_length, delta=delta,
                        worse_by=None if delta is None else -delta, tolerance=tolerance, floor=None, noise=None,
                        p_value=None, n_baseline=1, n_current=1,
                        reason=f"matrix {cell.row} -> {cell.engine} (vs own-features drafter): {cell.reason}")


def noise_decision(noise: RetrainNoise) -> Any:
    """The retraining-noise verdict as a gate decision: the largest seed-to-seed drop against the
    tolerance, with the reason."""
    from ..stats import GateDecision

    verdict, reason = noise.judge()
    return GateDecision(metric="accept_length", unit="tok/step", direction="higher", verdict=verdict,  # type: ignore[arg-type]
                        baseline=max(noise.accept_lengths), current=min(noise.accept_lengths),
                        delta=-noise.max_drop, worse_by=noise.max_drop, tolerance=noise.tolerance, floor=None,
                        noise=None, p_value=None, n_baseline=len(noise.seeds), n_current=len(noise.seeds),
                        reason=f"matrix retraining noise, {noise.row} -> {noise.engine}: {reason}")


def write_json(cells: Sequence[MatrixCell], path: Path, **meta: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, "cells": [c.to_json() for c in cells]}, indent=1) + "\n")
    return path
