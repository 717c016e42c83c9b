"""The package's import graph: no circles, and the engines stay below the gate.

Why a test: the circles this guards against were hidden by lazy (function-level) imports, which run
fine until someone moves one to module level or imports the module on its own. So the graph here is
read from the source (every ``import`` anywhere in a module, lazy ones and ``TYPE_CHECKING`` ones
included), not from what importing the package happens to load. Importing ``a.b.c`` also runs the
``__init__`` of ``a`` and ``a.b``, so those count as edges too, except a package the importer lives in
(that one is already being imported).

The layering rule: an engine adapter serves a model; it must not depend on how runs are gated
(profiles, statistics, baselines), or an engine change would have to go through gate configuration.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kimi_perf

PKG = Path(kimi_perf.__file__).parent
# modules an engine must not import: the gate's configuration and decisions
GATE_MODULES = ("kimi_perf.profiles", "kimi_perf.stats", "kimi_perf.baselines", "kimi_perf.plugin",
                "kimi_perf.report")


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _known(name: str, mods: dict[str, Path]) -> str | None:
    """The kimi_perf module ``name`` lands in (``from .x import y`` may name a function y)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _with_packages(target: str, importer: str, mods: dict[str, Path]) -> set[str]:
    """``target`` plus the package ``__init__``s importing it runs, minus the importer's own packages."""
    own = {importer.rsplit(".", k)[0] for k in range(1, importer.count(".") + 1)} | {importer}
    parts = target.split(".")
    chain = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {m for m in chain if m in mods and m not in own}


def _imports(mod: str, path: Path) -> list[tuple[ast.Import | ast.ImportFrom, list[str]]]:
    """Every import statement anywhere in module ``mod`` with the module(s) it names, a relative
    ``from`` resolved against the module's package."""
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: list[tuple[ast.Import | ast.ImportFrom, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.append((node, [a.name for a in node.names]))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                out.append((node, [".".join(base + ([node.module] if node.module else []))]))
            else:
                out.append((node, [node.module or ""]))
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        names: list[str] = []
        for node, srcs in _imports(mod, path):
            names += srcs
            if isinstance(node, ast.ImportFrom):  # `from x import y` may import the module x.y
                names += [f"{srcs[0]}.{a.name}" for a in node.names]
        edges: set[str] = set()
        for n in names:
            hit = _known(n, mods)
            if hit is not None and hit != mod:
                edges |= _with_packages(hit, mod, mods)
        graph[mod] = edges - {mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def unresolved_imports() -> list[str]:
    """``path:line module`` for every ``from X import ...`` (relative ones resolved) and ``import X``
    naming a kimi_perf module that does not exist."""
    mods = _modules()
    return [f"{path.relative_to(PKG.parent)}:{node.lineno} {s}" for mod, path in mods.items()
            for node, srcs in _imports(mod, path) for s in srcs
            if (s == "kimi_perf" or s.startswith("kimi_perf.")) and s not in mods]


def test_every_import_of_the_package_names_a_module_that_exists():
    """The graph above maps a name to its longest known prefix, so a wrong relative import reads as an
    edge to a real package. A lazy one then fails only when its function runs: ``from ..engines.reference
    .cuda_graphs import ...`` inside engines/reference/drafting.py (one dot too many after a move) passed
    every CPU test and killed the reference engine's EAGLE-3 server on the first GPU run, at model load
    (CUDA graphs of the drafter are captured on CUDA only)."""
    assert unresolved_imports() == []


def test_the_graph_is_read_from_source():
    """Guards the reader itself: lazy imports and package __init__ edges are seen."""
    g = import_graph()
    assert "kimi_perf.models.shapes" in g["kimi_perf.roofline"]  # module level
    assert "kimi_perf.models.shapes" in g["kimi_perf.engines.reference.microbench"]  # inside a function
    assert "kimi_perf.eagle3" in g["kimi_perf.alignment.extract"]  # the package __init__ of a lazy import
    assert "kimi_perf.engines.reference" not in g["kimi_perf.engines.reference.microbench"]  # its own package
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    found = cycles(import_graph())
    g = import_graph()
    detail = ["; ".join(f"{m} -> {sorted(e for e in g[m] if e in c)}" for m in c) for c in found]
    assert not found, "import circles (lazy imports count):\n  " + "\n  ".join(detail)


def test_engines_do_not_import_gate_configuration():
    bad = {m: sorted(e for e in edges if e in GATE_MODULES)
           for m, edges in import_graph().items() if m.startswith("kimi_perf.engines")}
    bad = {m: e for m, e in bad.items() if e}
    assert not bad, f"engine modules importing gate configuration: {bad}"


def test_each_marker_is_declared_once(pytestconfig):
    """One marker list: the suite's markers live in kimi_perf.options.MARKERS (the plugin registers them,
    so they exist wherever kimi-perf is installed); pyproject.toml lists only this repository's own
    unit-test markers. Before issue 27 both declared perf/alignment/... in different words."""
    import pytest

    from kimi_perf.options import MARKERS

    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")

    ini = tomllib.loads((PKG.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    local = {line.partition(":")[0].strip() for line in ini.get("markers", [])}
    assert not local & set(MARKERS), f"declared both in pyproject.toml and kimi_perf/options.py: {local & set(MARKERS)}"
    # what this session registered: every marker exactly once, the plugin's with the plugin's words
    names = [line.partition(":")[0].strip() for line in pytestconfig.getini("markers")]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"markers registered more than once: {twice}"
    assert {f"{n}: {d}" for n, d in MARKERS.items()} <= set(pytestconfig.getini("markers"))


def test_no_library_module_over_800_lines():
    """Issue 27: no library file over ~800 lines (kimi_perf/wheelhouse.py had 2,112 and ten concerns; it
    is a package of one concern per module now). A module that grows past this wants splitting."""
    big = {name: n for name, p in _modules().items() if (n := len(p.read_text().splitlines())) > 800}
    assert not big, f"library modules over 800 lines: {big}"


def _package_edges(graph: dict[str, set[str]], src: str, dst: str) -> list[str]:
    return sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith(src + ".") or m == src
                  for t in ts if t == dst or t.startswith(dst + "."))


def test_the_engines_sit_below_the_drafter_pipeline():
    """The reference engine serves EAGLE-3 drafters, so the drafter architecture and the drafting runtime
    live under engines/reference/ (drafter_model, drafting) and the training pipeline (kimi_perf.eagle3)
    imports them from there. engines/reference/loading importing kimi_perf.eagle3.runtime was the last
    arrow running back up."""
    g = import_graph()
    for up in ("kimi_perf.eagle3", "kimi_perf.alignment", "kimi_perf.suite"):
        assert not _package_edges(g, "kimi_perf.engines", up), _package_edges(g, "kimi_perf.engines", up)
    assert _package_edges(g, "kimi_perf.eagle3", "kimi_perf.engines.reference.drafter_model"), \
        "the pipeline no longer imports the drafter architecture from the engine: is this test still reading it?"


def test_the_capture_layer_sits_below_alignment_and_eagle3():
    """Hidden-state capture (per engine, with each engine's layer-id rule) is what alignment compares
    and what the EAGLE-3 feature pipeline trains on: both import it, it imports neither, and the
    pipeline does not reach into alignment for it (that package-level loop was one of two arrows
    running back up)."""
    g = import_graph()
    for up in ("kimi_perf.alignment", "kimi_perf.eagle3"):
        assert not _package_edges(g, "kimi_perf.capture", up), _package_edges(g, "kimi_perf.capture", up)
    assert not _package_edges(g, "kimi_perf.eagle3", "kimi_perf.alignment"), \
        _package_edges(g, "kimi_perf.eagle3", "kimi_perf.alignment")


FIXTURES = PKG.parent / "fixtures"
# a private helper a fixture module may keep (a line or two of glue); anything longer is library code
TINY_HELPER_LINES = 8


def _is_fixture(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated with ``pytest.fixture`` (bare or called, e.g. ``@pytest.fixture(scope="session")``)."""
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "fixture":
            return True
        if isinstance(target, ast.Name) and target.id == "fixture":
            return True
    return False


def fixture_module_violations(source: str) -> list[str]:
    """What a fixtures/ module defines beyond fixture functions and tiny private helpers."""
    bad = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            bad.append(f"class {node.name} (line {node.lineno})")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_fixture(node):
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            if not node.name.startswith("_") or n > TINY_HELPER_LINES:
                bad.append(f"function {node.name} ({n} lines, line {node.lineno})")
    return bad


def test_fixture_modules_define_only_fixtures():
    """Issue 27's rule: fixture functions live in fixtures/, the classes and helpers they use in the
    library (kimi_perf.suite), where a host repository's fixtures and unit tests import them. Before
    the move fixtures/ held ServerPool, AlignmentContext, Eagle3Runs, ... (1,350 lines)."""
    mods = sorted(FIXTURES.glob("*.py"))
    assert len(mods) > 1, f"no fixture modules found under {FIXTURES}"
    bad = {p.name: v for p in mods if (v := fixture_module_violations(p.read_text()))}
    assert not bad, f"fixtures/ may define only @pytest.fixture functions and tiny private helpers; move these " \
                    f"into kimi_perf/suite/: {bad}"


def test_the_fixture_rule_checker_sees_classes_and_helpers():
    """Guards the checker: a class, a public helper and a long private one are reported; fixtures
    (bare and called decorator) and a short private helper are not."""
    long_body = "\n".join(f"    x{i} = {i}" for i in range(TINY_HELPER_LINES))
    src = ("import pytest\nfrom pytest import fixture\n\nclass Pool:\n    pass\n\n"
           "def engine_config():\n    return 1\n\n"
           f"def _long():\n{long_body}\n\n"
           "def _short():\n    return 2\n\n"
           "@pytest.fixture(scope='session')\ndef pool():\n    return Pool()\n\n"
           "@fixture\ndef other():\n    return 3\n")
    found = fixture_module_violations(src)
    assert [f.split()[1] for f in found] == ["Pool", "engine_config", "_long"], found


def test_the_suite_sits_below_the_plugin():
    """kimi_perf.suite (the objects behind the fixtures) takes its specs from kimi_perf.session,
    not from the hook module, and the plugin does not import the suite: the suite's services are not
    part of what the pytest11 entry point loads."""
    g = import_graph()
    assert "kimi_perf.suite.servers" in g, "kimi_perf.suite is not read"
    up = _package_edges(g, "kimi_perf.suite", "kimi_perf.plugin")
    assert not up, up
    down = [e for m in ("kimi_perf.plugin", "kimi_perf.session", "kimi_perf.recorder")
            for e in _package_edges(g, m, "kimi_perf.suite")]
    assert not down, down


def test_the_suites_services_take_typed_specs_not_the_session():
    """kimi_perf.suite's classes and helpers take what they read (ServerSettings, Eagle3Settings, profile
    sections, a MissingPolicy), never the whole PerfSession: handed all of it, a service can come to
    depend on any of its 20 mutable fields (issue 27 item 2; PerfGate's GateContext is the model)."""
    mods = sorted((PKG / "suite").glob("*.py"))
    assert len(mods) > 5, "kimi_perf/suite is not read"
    bad = sorted({f"{p.name}:{node.lineno}" for p in mods for node in ast.walk(ast.parse(p.read_text()))
                  if (isinstance(node, ast.ImportFrom) and any(a.name == "PerfSession" for a in node.names))
                  or (isinstance(node, ast.Attribute) and node.attr == "PerfSession")})
    assert not bad, f"take a typed spec (kimi_perf.session.ServerSettings, ...) instead of PerfSession: {bad}"


def test_tests_take_the_suites_objects_from_the_library_not_from_fixtures():
    """Fixtures reach a test as arguments; anything a test imports by name lives in kimi_perf.suite.
    An import from fixtures/ in a test body only fails when that test runs (found after the move: the
    --perf-url acceptance test, which CI's default run skips, still imported missing() from there)."""
    import re

    bad = [f"{p.relative_to(PKG.parent)}:{i}" for d in ("tests", "perf_tests") for p in sorted((PKG.parent / d).rglob("*.py"))
           if p.name != "test_structure.py"
           for i, line in enumerate(p.read_text().splitlines(), 1) if re.match(r"\s*(from|import) fixtures\b", line)]
    assert not bad, f"import these from kimi_perf.suite instead: {bad}"
