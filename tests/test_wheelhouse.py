"""The offline wheelhouse builder (kimi_perf.wheelhouse) without the network: fake wheels and a fake pip
installation report in tmp_path. Covers the closure walk (target versions, clashes, target markers,
exclusions, pruning, pins and overrides), the wheel repack (RECORD valid, installs with pip), the
split into parts and the generated install.sh reassembling and installing them."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kimi_perf import wheelhouse as wh
from kimi_perf.wheelhouse import (
    Exclusion,
    InstalledPackage,
    Override,
    Status,
    TargetSpec,
    WheelhouseError,
)

TARGET = TargetSpec("3.12.3")


# ---------------------------------------------------------------------------------------------------
# Fakes


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(
    d: Path, name: str, version: str, requires: tuple[str, ...] = (), files: dict[str, bytes] | None = None
) -> Path:
    """A small valid pure-Python wheel (METADATA with Requires-Dist, WHEEL, RECORD)."""
    dist = re.sub(r"[-.]+", "_", name)
    files = files if files is not None else {f"{dist}/__init__.py": f"VERSION = {version!r}\n".encode()}
    di = f"{dist}-{version}.dist-info"
    meta = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires)
    ).encode()
    wheel = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    contents = {**files, f"{di}/METADATA": meta, f"{di}/WHEEL": wheel}
    record = "".join(f"{p},sha256={_b64(b)},{len(b)}\n" for p, b in contents.items()) + f"{di}/RECORD,,\n"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for p, b in contents.items():
            z.writestr(p, b)
        z.writestr(f"{di}/RECORD", record)
    return path


def item(
    name: str,
    version: str,
    requires: tuple[str, ...] = (),
    *,
    requested: bool = False,
    wheel: Path | None = None,
    extras: tuple[str, ...] = (),
) -> dict:
    """One ``install`` entry of a pip installation report (format version 1)."""
    if wheel is not None:
        url, sha = wheel.as_uri(), hashlib.sha256(wheel.read_bytes()).hexdigest()
    else:
        url, sha = f"https://example.invalid/{name}-{version}-py3-none-any.whl", "0" * 64
    out = {
        "download_info": {"url": url, "archive_info": {"hash": f"sha256={sha}", "hashes": {"sha256": sha}}},
        "is_direct": False,
        "requested": requested,
        "metadata": {
            "metadata_version": "2.1",
            "name": name,
            "version": version,
            "requires_dist": list(requires),
        },
    }
    if extras:
        out["requested_extras"] = list(extras)
    return out


def report(*items: dict) -> dict:
    return {"version": "1", "pip_version": "23.2.1", "install": list(items), "environment": {}}


ENGINE_REQS = (
    "liba>=1.0",
    "libb==2.0",
    "libc; python_version < '3.12'",  # host-Python-only: not needed on a 3.12 target
    "libd; python_version >= '3.12'",
    "unused-x",
    "libe[fast]",
    "libh",
    "libz; sys_platform == 'win32'",
)
CLOSURE = report(
    item("engine", "1.0", ENGINE_REQS, requested=True),
    item("liba", "1.2", ("libf",)),  # on the target: libf is then only needed by a left-out package
    item("libb", "2.0"),  # the target has 3.0: clash
    item("libc", "1.0"),
    item("libd", "1.0", ("libh>=2",)),  # second specifier on libh makes the target's 1.0 clash
    item("unused-x", "1.0", ("only-unused",)),
    item("only-unused", "1.0"),
    item("libe", "1.0", ("libg; extra == 'fast'", "libnope; extra == 'slow'")),
    item("libf", "1.0"),
    item("libg", "1.0"),
    item("libh", "2.5"),
    item("libnope", "1.0"),
    item("Lib_Unknown", "4.0"),
)
INSTALLED = wh.parse_target_list("liba==1.5\nlibb==3.0\nlibh==1.0\nlib-unknown\n")


def plan_of(rep: dict = CLOSURE, **kw) -> wh.Plan:
    kw.setdefault("installed", INSTALLED)
    kw.setdefault("exclusions", [Exclusion("unused-*", "never imported")])
    return wh.make_plan(wh.parse_report(rep), TARGET, **kw)


# ---------------------------------------------------------------------------------------------------
# Target description and list


def test_target_list_formats():
    text = """# comment
Package            Version
------------------ -----------
torch              2.11.0+cu130
huggingface_hub==1.33.0
Jinja2===3.1.6
nvidia-cudnn-cu13
mypkg @ file:///tmp/mypkg-1.0-py3-none-any.whl
-e git+https://x/y#egg=z
"""
    got = wh.parse_target_list(text)
    assert got["torch"] == InstalledPackage("torch", "2.11.0+cu130")
    assert got["huggingface-hub"].version == "1.33.0"
    assert got["jinja2"].version == "3.1.6"
    assert got["nvidia-cudnn-cu13"].version is None and got["mypkg"].version is None
    with pytest.raises(WheelhouseError, match="list:2: cannot read"):
        wh.parse_target_list("ok==1\n!!! what\n", "list")


def test_bundled_target_list_and_platforms():
    installed, path = wh.load_target_list("h200-torch2.11-cu130")
    assert path and installed["torch"].version == "2.11.0+cu130"
    assert installed["transformers"].version == "5.17.0" and installed["cuda-bindings"].version is None
    tags = wh.expand_platforms("manylinux_2_17..2_39_x86_64")
    assert tags[0] == "manylinux_2_39_x86_64" and "manylinux_2_17_x86_64" in tags
    assert "manylinux2014_x86_64" in tags and "manylinux2010_x86_64" not in tags
    assert TARGET.marker_env()["python_full_version"] == "3.12.3" and TARGET.machine == "x86_64"
    with pytest.raises(ValueError, match="Linux tags only"):
        TargetSpec("3.12", ("macosx_11_0_arm64",))


# ---------------------------------------------------------------------------------------------------
# The closure walk


def test_installed_satisfying_left_out_and_clashing_kept():
    plan = plan_of()
    a = plan.entry("liba")
    assert a.status is Status.ON_TARGET and "liba 1.5 satisfies >=1.0" in a.reason
    b = plan.entry("libb")
    assert b.status is Status.CLASH
    assert (
        b.reason
        == "clash: the target's libb 3.0 does not satisfy ==2.0, carried 2.0 (required by engine 1.0)"
    )
    # libh: "any version" from engine is met by the target's 1.0, libd's ">=2" is not -> carried
    h = plan.entry("libh")
    assert h.status is Status.CLASH and "does not satisfy >=2" in h.reason and "libd 1.0" in h.reason
    assert set(plan.clash_lines) == {b.reason, h.reason}
    # listed without a version: left out, but reported as unverified
    assert plan.entry("lib-unknown").status is Status.NOT_NEEDED  # nobody needs it in this closure
    assert {e.name for e in plan.kept} == {"engine", "libb", "libd", "libe", "libg", "libh"}


def test_markers_are_evaluated_for_the_target_python():
    plan = plan_of()
    assert plan.entry("libc").status is Status.NOT_NEEDED  # python_version < 3.12 (true on a 3.11 host)
    assert plan.entry("libd").status is Status.CARRY  # python_version >= 3.12
    assert plan.entry("libg").status is Status.CARRY  # via the requested extra libe[fast]
    assert plan.entry("libnope").status is Status.NOT_NEEDED  # extra 'slow' not requested
    old = wh.make_plan(wh.parse_report(CLOSURE), TargetSpec("3.10"), installed=INSTALLED)
    assert old.entry("libc").status is Status.CARRY and old.entry("libd").status is Status.NOT_NEEDED
    # the target needs a requirement the report lacks (pip ran under another Python): reported as missing
    rep = report(item("engine", "1.0", ("tomli; python_version >= '3.12'",), requested=True))
    plan = wh.make_plan(wh.parse_report(rep), TARGET)
    assert plan.missing and plan.missing[0].startswith("tomli (needed by engine 1.0)")


def test_glob_exclusions_with_reasons_and_pruning():
    plan = plan_of()
    x = plan.entry("unused-x")
    assert x.status is Status.UNUSED and x.reason == "unused (unused-*): never imported"
    only = plan.entry("only-unused")
    assert only.status is Status.PRUNED and "unused-x 1.0 (unused)" in only.reason
    f = plan.entry("libf")
    assert f.status is Status.PRUNED and "liba 1.2 (on-target)" in f.reason
    # PEP 503 names: a glob matches whatever spelling the index uses
    assert Exclusion("nvidia-cutlass-dsl*").matches("nvidia_cutlass_dsl_libs_base")
    assert Exclusion.parse("py-spy:profiler").reason == "profiler"
    # a name the target lists without a version, needed by the closure: left out and unverified
    rep = report(item("engine", "1.0", ("lib-unknown==4.0",), requested=True), item("Lib_Unknown", "4.0"))
    plan = plan_of(rep)
    assert plan.entry("lib-unknown").status is Status.ON_TARGET
    assert plan.unverified == ("Lib_Unknown ==4.0",)


def test_trusted_target_package_left_out_despite_clash():
    plan = plan_of(trusted=["libb"])
    b = plan.entry("libb")
    assert b.status is Status.ON_TARGET and "trusted" in b.reason and "==2.0" in b.reason


def test_overrides_replace_the_resolved_version_and_are_reported():
    rep = report(
        item("engine", "1.0", ("tvm-ffi==0.1.10", "grammar"), requested=True),
        item("tvm-ffi", "0.1.10"),
        item("grammar", "0.2", ("tvm-ffi>=0.1.10",)),
    )
    asked = []

    def fetch(ov: Override) -> wh.ResolvedPackage:
        asked.append(ov.requirement)
        return wh.parse_report(report(item("tvm_ffi", "0.1.11")))[0]

    ov = Override("tvm-ffi==0.1.11", "grammar 0.3 needs it")
    pkgs, overridden, notes = wh.apply_overrides(wh.parse_report(rep), [ov], fetch)
    assert asked == ["tvm-ffi==0.1.11"] and overridden == {"tvm-ffi": ("0.1.10", ov)}
    plan = wh.make_plan(pkgs, TARGET, overridden=overridden)
    e = plan.entry("tvm-ffi")
    assert e.status is Status.OVERRIDE and e.version == "0.1.11"
    assert "instead of the resolved 0.1.10 although engine 1.0 requires ==0.1.10" in e.reason
    assert "grammar 0.3 needs it" in e.reason and e.reason in plan.clash_lines
    # already what the resolver chose: nothing fetched
    _, done, notes = wh.apply_overrides(wh.parse_report(rep), [Override("tvm-ffi==0.1.10")], fetch)
    assert done == {} and "already chose it" in notes[0] and len(asked) == 1
    with pytest.raises(ValueError, match="NAME==VERSION"):
        Override("tvm-ffi>=0.1")


def test_pins_go_to_pip_as_constraints_and_missing_requirements_resolve_again(monkeypatch, tmp_path):
    calls = []

    def fake_pip_report(reqs, target, *, python, workdir, constraints=(), no_deps=False, pip_args=(), tag=""):
        calls.append((list(reqs), list(constraints)))
        if len(calls) == 1:  # as if pip ran under a 3.11 host: the 3.12-only requirement is absent
            return report(item("engine", "1.0", ("tomli; python_version >= '3.12'",), requested=True))
        return report(
            item("engine", "1.0", ("tomli; python_version >= '3.12'",), requested=True),
            item("tomli", "2.0", requested=True),
        )

    monkeypatch.setattr(wh.resolve, "pip_report", fake_pip_report)  # where resolve_and_plan looks it up
    plan = wh.resolve_and_plan(
        ["engine==1.0"],
        TARGET,
        pins=["torch==2.11.0"],
        workdir=tmp_path,
        resolver_python=sys.executable,
        sizes=False,
        say=lambda m: None,
    )
    assert calls == [(["engine==1.0"], ["torch==2.11.0"]), (["engine==1.0", "tomli"], ["torch==2.11.0"])]
    assert not plan.missing and plan.entry("tomli").status is Status.CARRY


def test_sizing_replans_with_the_same_rules_and_keeps_the_rounds_notes(monkeypatch, tmp_path):
    """The plan is made twice (after the rounds, after sizing): the second must carry the sizes and
    keep what the first noted, under the same roots and rules."""
    rounds = iter([report(item("engine", "1.0", ("tomli; python_version >= '3.12'",), requested=True)),
                   report(item("engine", "1.0", ("tomli; python_version >= '3.12'",), requested=True),
                          item("tomli", "2.0", requested=True))])
    monkeypatch.setattr(wh.resolve, "pip_report", lambda *a, **kw: next(rounds))
    monkeypatch.setattr(wh.resolve, "fetch_sizes", lambda packages: {p.url: 1000 * (i + 1)
                                                                      for i, p in enumerate(packages)})
    plan = wh.resolve_and_plan(["engine==1.0"], TARGET, workdir=tmp_path, resolver_python=sys.executable,
                               sizes=True, say=lambda m: None)
    assert {plan.entry(k).size for k in ("engine", "tomli")} == {1000, 2000}
    assert any("added as roots for the target's markers: tomli" in n for n in plan.notes)
    assert plan.entry("tomli").status is Status.CARRY


def test_engine_defaults():
    found, notes = wh.defaults_for(["sglang==0.5.17", "vllm==0.26.0", "sglang==0.5.18", "numpy"])
    assert [(d.engine, d.version) for d in found] == [("sglang", "0.5.17"), ("vllm", "0.26.0")]
    assert "no observed defaults for sglang==0.5.18" in notes[0] and len(notes) == 1
    sgl, vllm = found
    assert "transformers==5.12.1" in sgl.pins and "tokenizers==0.22.2" in sgl.pins
    assert any(x.matches("tokenspeed-triton") for x in sgl.excludes)
    assert not any(x.matches("torchcodec") for x in sgl.excludes)
    assert any(x.matches("torchcodec") for x in vllm.excludes)
    assert [o.requirement for o in vllm.overrides] == ["apache-tvm-ffi==0.1.11"]


def test_pip_errors_name_the_fix():
    e = wh.resolve._pip_error("ERROR: Cannot install a and b\nResolutionImpossible: ...\n", "resolution", TARGET)
    assert "--pin NAME==VERSION" in str(e) and "--override" in str(e)
    e = wh.resolve._pip_error("ERROR: No matching distribution found for foo==1.0\n", "resolution", TARGET)
    assert "--platform" in str(e) and "foo==1.0" in str(e)


def test_cli_plan_from_a_report(tmp_path, capsys):
    (tmp_path / "r.json").write_text(json.dumps(CLOSURE))
    (tmp_path / "t.txt").write_text("liba==1.5\nlibb==3.0\nlibh==1.0\n")
    rc = wh.main(
        [
            "plan",
            "--spec",
            "engine==1.0",
            "--report",
            str(tmp_path / "r.json"),
            "--python",
            "3.12",
            "--target-list",
            str(tmp_path / "t.txt"),
            "--exclude",
            "unused-*:never imported",
            "--no-sizes",
            "--json",
            str(tmp_path / "plan.json"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "clash: the target's libb 3.0 does not satisfy ==2.0, carried 2.0" in out
    assert "carry 6 wheels" in out
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert {e["name"] for e in saved["kept"]} == {"engine", "libb", "libd", "libe", "libg", "libh"}


# ---------------------------------------------------------------------------------------------------
# Repack


def _check_record(path: Path) -> dict[str, bytes]:
    """Every member but RECORD is listed in RECORD with its sha256 and size, and nothing else is."""
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if not n.endswith("/")]
        rec_name = next(n for n in names if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.StringIO(z.read(rec_name).decode())))
        listed = {r[0]: r for r in rows}
        assert set(listed) == set(names)
        assert listed[rec_name][1:] == ["", ""]
        for n in names:
            if n != rec_name:
                data = z.read(n)
                assert listed[n][1:] == [f"sha256={_b64(data)}", str(len(data))], n
        return {n: z.read(n) for n in names}


def test_repack_drops_members_rewrites_record_and_installs(tmp_path):
    files = {
        "kern/__init__.py": b"import os\nHERE = os.path.dirname(__file__)\n",
        "kern/flash_ops.abi3.so": os.urandom(50_000),
        "kern/sm100/common_ops.abi3.so": os.urandom(20_000),
        "kern/sm90/common_ops.abi3.so": b"\x7fELF sm90",
    }
    src = make_wheel(tmp_path / "src", "sglang-kernel", "0.4.5", ("torch",), files)
    res = wh.repack_wheel(src, tmp_path / "out", ["kern/flash_ops.abi3.so", "kern/sm100/*"])
    assert res.wheel.name == "sglang_kernel-0.4.5-1repack-py3-none-any.whl"
    assert sorted(res.dropped) == ["kern/flash_ops.abi3.so", "kern/sm100/common_ops.abi3.so"]
    assert res.saved > 60_000 and res.bytes_after == res.wheel.stat().st_size
    members = _check_record(res.wheel)
    assert "kern/sm90/common_ops.abi3.so" in members and "kern/flash_ops.abi3.so" not in members
    assert b"Build: 1repack" in members["sglang_kernel-0.4.5.dist-info/WHEEL"]
    site = tmp_path / "site"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--disable-pip-version-check",
            "--target",
            str(site),
            str(res.wheel),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert (site / "kern/sm90/common_ops.abi3.so").exists() and not (site / "kern/sm100").exists()
    assert not (site / "kern/flash_ops.abi3.so").exists()
    # keep the file name (no build tag), and refuse patterns that match nothing
    same = wh.repack_wheel(src, tmp_path / "same", ["kern/sm100/*"], build_tag=None)
    assert same.wheel.name == src.name
    _check_record(same.wheel)
    with pytest.raises(WheelhouseError, match="match no member"):
        wh.repack_wheel(src, tmp_path / "x", ["kern/sm120/*"])


# ---------------------------------------------------------------------------------------------------
# Packing, splitting, install.sh


def test_parts_bounded_concatenate_to_the_tar_and_are_reproducible(tmp_path):
    files = []
    for i, n in enumerate((10_000, 3, 25_000)):
        p = tmp_path / f"w{i}.whl"
        p.write_bytes(os.urandom(n))
        files.append((f"wheels/{p.name}", p))
    res = wh.pack_parts(
        files, tmp_path / "parts", "wh", 8192, extra={"wheelhouse.lock": b"x\n"}, keep_tar=True
    )
    tar = (tmp_path / "parts" / "wh.tar").read_bytes()
    parts = [(tmp_path / "parts" / p.file).read_bytes() for p in res.parts]
    assert [p.file for p in res.parts] == [f"wh.tar.part-{i:03d}" for i in range(len(parts))]
    assert all(len(b) <= 8192 for b in parts) and all(len(b) == 8192 for b in parts[:-1])
    assert b"".join(parts) == tar and res.tar_size == len(tar)
    assert res.tar_sha256 == hashlib.sha256(tar).hexdigest()
    assert [p.sha256 for p in res.parts] == [hashlib.sha256(b).hexdigest() for b in parts]
    assert res.members == ("wheelhouse.lock", "wheels/w0.whl", "wheels/w1.whl", "wheels/w2.whl")
    again = wh.pack_parts(files, tmp_path / "parts2", "wh", 8192, extra={"wheelhouse.lock": b"x\n"})
    assert again.tar_sha256 == res.tar_sha256
    split = wh.split_file(tmp_path / "parts" / "wh.tar", tmp_path / "split", "wh", 8192)
    assert split.parts == res.parts
    assert wh.parse_part_size("60M") == 60 << 20 and wh.parse_part_size("512K") == 512 << 10
    with pytest.raises(WheelhouseError, match="60M"):
        wh.parse_part_size("lots")


def test_build_manifest_stage_and_install_sh(tmp_path):
    wheels = tmp_path / "index"
    eng = make_wheel(
        wheels,
        "tiny-engine",
        "1.0",
        ("tiny-dep>=1", "tiny-clash==2.0", "tiny-there", "tiny-unused"),
        {
            "tiny_engine/__init__.py": b"import tiny_dep, tiny_clash\nOK = tiny_clash.V\n",
            "tiny_engine/blob.bin": os.urandom(30_000),
        },
    )
    dep = make_wheel(wheels, "tiny-dep", "1.1")
    clash = make_wheel(wheels, "tiny-clash", "2.0", files={"tiny_clash/__init__.py": b"V = '2.0'\n"})
    rep = report(
        item(
            "tiny-engine",
            "1.0",
            ("tiny-dep>=1", "tiny-clash==2.0", "tiny-there", "tiny-unused"),
            requested=True,
            wheel=eng,
        ),
        item("tiny-dep", "1.1", wheel=dep),
        item("tiny-clash", "2.0", wheel=clash),
        item("tiny-there", "1.0"),
        item("tiny-unused", "1.0"),
    )
    plan = wh.make_plan(
        wh.parse_report(rep),
        TARGET,
        installed=wh.parse_target_list("tiny-clash==3.0\ntiny-there\n"),
        exclusions=[Exclusion("tiny-unused", "never imported")],
    )
    out = tmp_path / "out"
    res = wh.build(plan, out, name="wh-test", part_size=16 << 10, say=lambda m: None)
    assert len(res.parts) >= 2 and all(p.size <= 16 << 10 for p in res.parts)
    manifest = json.loads(res.manifest.read_text())
    assert [p["file"] for p in manifest["parts"]] == [p.file for p in res.parts]
    assert {k["name"] for k in manifest["kept"]} == {"tiny-engine", "tiny-dep", "tiny-clash"}
    assert {k["name"]: k["status"] for k in manifest["left_out"]} == {
        "tiny-there": "on-target",
        "tiny-unused": "unused",
    }
    assert manifest["clashes"] == [
        "clash: the target's tiny-clash 3.0 does not satisfy ==2.0, carried 2.0 (required by tiny-engine 1.0)"
    ]
    joined = b"".join((out / "parts" / p["file"]).read_bytes() for p in manifest["parts"])
    assert hashlib.sha256(joined).hexdigest() == manifest["tar"]["sha256"]

    # one part at a time into a transfer folder, as the device tool carries them
    remote = tmp_path / "remote"
    remote.mkdir()
    for i in range(len(res.parts)):
        staged = wh.stage_part(out, i, tmp_path / "carry")
        assert sorted(p.name for p in (tmp_path / "carry").iterdir()) == sorted(s.name for s in staged)
        assert [p.name for p in staged][0] == res.parts[i].file
        for s in staged:
            (remote / s.name).write_bytes(s.read_bytes())
        if i == 0:
            check = subprocess.run(
                ["bash", str(remote / "install.sh"), "--check"], capture_output=True, text=True
            )
            assert check.returncode == 3 and "missing: wh-test.tar.part-001" in check.stderr
    site = tmp_path / "site"
    env = {**os.environ, "SITE": str(site), "PYTHON": sys.executable, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    r = subprocess.run(["bash", str(remote / "install.sh")], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"installed 3 wheels into {site}" in r.stdout and f"export PYTHONPATH={site}" in r.stdout
    r = subprocess.run(
        [sys.executable, "-c", "import tiny_engine; print(tiny_engine.OK)"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(site)},
    )
    assert r.stdout.strip() == "2.0", r.stderr

    # a damaged part is caught before anything is installed
    bad = remote / res.parts[0].file
    bad.write_bytes(b"x" + bad.read_bytes()[1:])
    r = subprocess.run(["bash", str(remote / "install.sh")], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and f"damaged (copy again): {res.parts[0].file}" in r.stderr
