"""The perf tests run in an order that launches each engine server once, whatever order pytest's
fixture-sharing reorder produced (it differs between pytest 9.1 and 9.2)."""

from __future__ import annotations

import random

import pytest

from kimi_perf.session import server_affine_order

pytest_plugins = ["pytester"]
# the items alone, without the installed plugin activating a session for these perf-marked tests
NO_PLUGIN = ("-p", "no:kimi_perf.plugin")

SOURCE = """
import pytest

@pytest.mark.perf
@pytest.mark.parametrize("perf_concurrency", [1, 8, 32], ids=["c1", "c8", "c32"])
@pytest.mark.parametrize("perf_engine_name", ["reference", "vllm"])
def test_sweep(perf_engine_name, perf_concurrency):
    pass

@pytest.mark.perf
def test_no_engine():
    pass

@pytest.mark.perf
@pytest.mark.parametrize("align_engine", ["vllm", "reference"])
def test_engine_fixture(align_engine):
    pass

def test_plain_b():
    pass

def test_plain_a():
    pass
"""


def test_items_are_grouped_by_engine_then_written_order(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_a=SOURCE)
    items, _ = pytester.inline_genitems(*NO_PLUGIN)
    plain = [i for i in items if i.get_closest_marker("perf") is None]
    shuffled = list(items)
    random.Random(7).shuffle(shuffled)
    got = [i.name for i in server_affine_order(shuffled, ("reference", "vllm"))]
    perf = [n for n in got if not n.startswith("test_plain")]
    assert perf == [
        "test_sweep[reference-c1]", "test_sweep[reference-c8]", "test_sweep[reference-c32]",
        "test_no_engine", "test_engine_fixture[reference]",
        "test_sweep[vllm-c1]", "test_sweep[vllm-c8]", "test_sweep[vllm-c32]", "test_engine_fixture[vllm]",
    ]
    # tests that are not perf tests keep the relative order pytest gave them
    assert [n for n in got if n.startswith("test_plain")] == [i.name for i in shuffled if i in plain]


def test_sweep_moved_behind_other_modules_comes_back(pytester: pytest.Pytester) -> None:
    """pytest 9.1's reorder put test_concurrency_sweep[c8..] after every other module's tests."""
    pytester.makepyfile(test_a=SOURCE, test_b="import pytest\n\n@pytest.mark.perf\ndef test_b():\n    pass\n")
    items, _ = pytester.inline_genitems(*NO_PLUGIN)
    by = {i.nodeid: i for i in items}
    late = [i for i in items if i.nodeid.endswith(("-c8]", "-c32]"))]
    pytest_order = [i for i in items if i not in late] + late
    got = [i.nodeid for i in server_affine_order(pytest_order, ("reference", "vllm")) if "plain" not in i.nodeid]
    assert got.index("test_b.py::test_b") == len(got) - 1
    assert got[:3] == ["test_a.py::test_sweep[reference-c1]", "test_a.py::test_sweep[reference-c8]",
                       "test_a.py::test_sweep[reference-c32]"]
    assert set(got) == {n for n in by if "plain" not in n}
