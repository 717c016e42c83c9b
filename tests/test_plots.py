"""Pictures a person reads (issue 25 item 7): the matrix heatmap coloured by each cell's pass/fail
against its own threshold, and throughput.png with the baseline, the repeats' spread and a title that
names model, hardware, engines and versions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kimi_perf.eagle3.matrix import (
    STATE_COLOURS,
    LayerAgreement,
    MatrixCell,
    cell_from_json,
    heatmap_states,
    render_heatmap,
)
from kimi_perf.report import _plot_throughput, plot_title, store_baseline

ROOT = Path(__file__).resolve().parents[1]


def _cell(row, engine, cos, thr, verdict, planted=False):
    return MatrixCell(row=row, engine=engine, planted=planted, layers=(LayerAgreement(2, cos, thr),),
                      accept_length=1.3, pos_rates=(0.3,), own_accept_length=1.3, verdict=verdict, reason="r")


def _has_colour(img: np.ndarray, hex_colour: str) -> int:
    from matplotlib.colors import to_rgb

    rgb = np.array(to_rgb(hex_colour))
    return int((np.abs(img[..., :3] - rgb) < 2 / 255).all(axis=-1).sum())


def test_heatmap_cells_are_coloured_by_their_threshold_not_by_the_data_range(tmp_path):
    """A cosine of 0.84 against a 0.80 threshold passes (green) and 0.99 against 0.995 fails (red): the
    colour follows each cell's own threshold. On a min-to-max scale the 0.84 was the reddest cell."""
    cells = [_cell("loose", "reference", 0.84, 0.80, "PASS"), _cell("tight", "reference", 0.99, 0.995, "FAIL"),
             _cell("hf+int8", "reference", 0.1, 0.9, "INCONCLUSIVE", planted=True)]
    rows, engines, cos, acc = heatmap_states(cells)
    assert rows == ["loose", "tight", "hf+int8"] and engines == ["reference"]
    assert cos == [["PASS"], ["FAIL"], ["FAIL"]] and acc == [["PASS"], ["FAIL"], ["INCONCLUSIVE"]]
    import matplotlib.image as mpimg

    img = mpimg.imread(render_heatmap(cells, tmp_path / "m.png"))
    for state in ("PASS", "FAIL", "INCONCLUSIVE"):
        assert _has_colour(img, STATE_COLOURS[state]) > 500, state


def test_the_stored_matrix_redraws_with_planted_faults_red_and_real_paths_green(tmp_path):
    data = json.loads((ROOT / "benchmarks" / "eagle3-matrix-cpu" / "eagle3-matrix-full.json").read_text())
    cells = [cell_from_json(c) for c in data["cells"]]
    assert [c.to_json()["layers"] for c in cells] == [c["layers"] for c in data["cells"]]  # round trip
    rows, _, cos, acc = heatmap_states(cells)
    for r, cs, ac in zip(rows, cos, acc):
        assert cs == (["FAIL", "FAIL"] if "+" in r else ["PASS", "PASS"]), r
        assert ac == (["INCONCLUSIVE"] * 2 if "+" in r else ["PASS", "PASS"]), r
    assert render_heatmap(cells, tmp_path / "full.png", title="full").stat().st_size > 20_000


def test_throughput_plot_overlays_the_baseline_and_names_what_it_measured(tmp_path):
    from kimi_perf.baselines import BaselineStore

    run = json.loads((ROOT / "benchmarks" / "h200-engines-lease" / "run-vllm.json").read_text())
    store = BaselineStore(ROOT / "baselines" / "h200-engines.json", "h200-engines")
    asked = []
    base = store_baseline(store)

    def spy(key, metric):
        got = base(key, metric)
        asked.append((key["concurrency"], metric, got is not None))
        return got

    assert _plot_throughput(run["results"], tmp_path / "t.png", baseline=spy, machine=run["machine"],
                            profile="h200-engines").is_file()
    sweep = sorted(r["key"]["concurrency"] for r in run["results"] if r["key"]["scenario"] == "throughput_sweep")
    assert sorted(c for c, m, found in asked if m == "output_throughput" and found) == sweep
    assert {m for _, m, _ in asked} == {"output_throughput", "tpot_ms_p50"}
    title = plot_title(run["results"], run["machine"], "h200-engines")
    assert title == "SmolLM2-135M-Instruct on 1x NVIDIA H200\nengines: vllm 0.26.0; profile h200-engines"
    cpu = plot_title(run["results"][:1], {"cpu": "AMD EPYC 7B13", "cpu_count": 2, "gpus": []}, None)
    assert cpu.startswith("SmolLM2-135M-Instruct on CPU AMD EPYC 7B13 (2 cores)")
    # no sweep, no plot; a key of another shape has no baseline rather than an error
    assert _plot_throughput([r for r in run["results"] if r["key"]["scenario"] != "throughput_sweep"],
                            tmp_path / "none.png") is None
    assert base({"scenario": "x"}, "output_throughput") is None
