"""The extraction-path x serving-engine matrix: the seed's question ("do our training features match
what the serving engine computes, and is that why the drafter accepts nothing?") answered by a test.

Rows are extraction paths of the training features (transformers, the reference engine, vLLM's
``extract_hidden_states``, and planted faults on a good path), columns serving engines. Each cell holds
the per-layer cosine of the row's features against that engine's inference states and the acceptance
of the drafter trained on the row's features, served by that engine; kimi_perf.eagle3.matrix states the
gates. Baselines key each cell by extraction path (the workload's suffix) and serving engine (the key's
engine), so the history of every cell is kept.

The aligned-path gate's tolerance is measured too: ``test_matrix_retrain_noise`` (marker ``matrix_noise``)
trains each engine's own-features drafter with several seeds on the same samples and checks that
retraining alone stays inside the tolerance (kimi_perf.eagle3.matrix.RetrainNoise).

Two sizes: ``test_extraction_matrix_reduced`` runs the profile's ``eagle3.matrix.ci`` rows and engines
(two paths, one engine on embedded-cpu: one extra drafter, ~4 CPU minutes) on every merge; the full
matrix (~6 drafters, two engines, under 30 CPU minutes) is marked ``matrix`` and runs only when ``-m``
names it: ``pytest -m matrix``.
"""

from __future__ import annotations

import pytest

from kimi_perf.progress import log

pytestmark = [pytest.mark.perf, pytest.mark.eagle]


def _run(label: str, rows, engines, extraction_matrix, perf_session, target_model, perf_gate) -> None:
    from kimi_perf.eagle3.matrix import cell_decision, render_heatmap, render_markdown, write_json
    from kimi_perf.keys import matrix_workload

    cells = extraction_matrix.cells(rows, engines)
    title = f"EAGLE-3 extraction path x serving engine ({label}, {perf_session.profile.name})"
    md = render_markdown(cells, title=title)
    # the cells are written and gated before the heatmap is drawn: a GPU job's minutes of training and
    # serving must not be lost to a plotting library its image lacks (the lent GPU's has no kimi-perf
    # install, so matplotlib is not guaranteed there); a missing one fails the test after the records
    js = write_json(cells, perf_session.report_dir / f"eagle3-matrix-{label}.json", profile=perf_session.profile.name,
                    accept_tolerance=extraction_matrix.plan.accept_tolerance)
    png = perf_session.report_dir / f"eagle3-matrix-{label}.png"
    log(f"{md}\ncells {js}")
    decisions = []
    for i, c in enumerate(cells):
        d = cell_decision(c, extraction_matrix.plan.accept_tolerance)
        decisions += perf_gate.check(
            scenario="eagle3_matrix", engine=c.engine, model=target_model.name,
            workload=matrix_workload(perf_session.profile, c.row), concurrency=1, samples=c.samples(),
            gated=["accept_length"], dependent=["accept_length"], decided=[d], fail=False,
            extra={"cell": c.to_json(), "heatmap": str(png), **({"markdown": md} if i == len(cells) - 1 else {})})
    try:
        render_heatmap(cells, png)
    except ImportError as ex:
        pytest.fail(f"the matrix's cells are in {js} and every report, but its heatmap needs matplotlib ({ex}): "
                    "pip install matplotlib (a kimi-perf dependency) into the runner's environment", pytrace=False)
    log(f"heatmap {png}")
    fails = [d for d in decisions if d.verdict == "FAIL"]
    if fails and not perf_session.update:
        pytest.fail("extraction-path matrix:\n  " + "\n  ".join(d.message() for d in fails), pytrace=False)


def test_extraction_matrix_reduced(extraction_matrix, perf_session, target_model, perf_gate):
    """The profile's eagle3.matrix.ci rows x engines (on embedded-cpu: transformers and reference-engine
    features, served by the reference engine): a path that agrees by cosine must accept like the
    engine's own features."""
    p = extraction_matrix.plan
    _run("ci", p.ci_rows, p.ci_engines, extraction_matrix, perf_session, target_model, perf_gate)


@pytest.mark.matrix
def test_extraction_matrix(extraction_matrix, perf_session, target_model, perf_gate):
    """Every row of eagle3.matrix.rows (real paths and planted faults) x every engine of
    eagle3.matrix.engines."""
    p = extraction_matrix.plan
    _run("full", p.rows, p.engines, extraction_matrix, perf_session, target_model, perf_gate)


@pytest.mark.matrix_noise
def test_matrix_retrain_noise(extraction_matrix, perf_session, target_model, perf_gate):
    """Each matrix engine's own-features drafter, trained with eagle3.matrix.retrain_seeds seeds on the
    same samples and features: no seed may fall further below another than accept_tolerance, or the
    aligned-path gate fails real paths by chance (and a planted drop inside that spread proves nothing)."""
    import json

    from kimi_perf.eagle3.matrix import noise_decision
    from kimi_perf.keys import matrix_workload

    p = extraction_matrix.plan
    decisions, out = [], []
    for engine in p.engines:
        noise = extraction_matrix.retrain_noise(engine)
        d = noise_decision(noise)
        log(d.message())
        out.append(noise.to_json())
        decisions += perf_gate.check(
            scenario="eagle3_matrix_retrain", engine=engine, model=target_model.name,
            workload=matrix_workload(perf_session.profile, noise.row), concurrency=1,
            samples={"accept_length": list(noise.accept_lengths)}, gated=["accept_length"], decided=[d], fail=False,
            extra={"retrain_noise": noise.to_json()})
    path = perf_session.report_dir / "eagle3-matrix-retrain-noise.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"profile": perf_session.profile.name, "engines": out}, indent=1) + "\n")
    fails = [d for d in decisions if d.verdict == "FAIL"]
    if fails and not perf_session.update:
        pytest.fail("matrix retraining noise:\n  " + "\n  ".join(d.message() for d in fails), pytrace=False)
