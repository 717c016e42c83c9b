"""Offline wheelhouse builder: bring an inference engine to an air-gapped GPU runner as wheels, in parts.

Why: GPU runners are often air-gapped -- our lent H200 box reaches nothing outside itself -- and what
can be carried to one is capped per transfer (64 MiB a call there). An engine such as
``sglang==0.5.17`` or ``vllm==0.26.0`` therefore has to arrive as wheels, split into parts, and only
the wheels the runner lacks: its torch, CUDA libraries and most of the scientific stack are already
installed, and re-carrying them would cost gigabytes and could shadow the runner's own builds.

What it does (``plan`` stops after step 3, ``build`` does all of it):

1. Resolve the engine's closure for the *target* (Python version, manylinux platform tags,
   implementation), not for this machine, with pip itself: ``pip install --dry-run --ignore-installed
   --only-binary=:all: --python-version X --implementation cp --platform ... --target TMP --report
   FILE SPEC`` and pip's installation report (format version 1; pip's documentation page
   "Installation Report", https://pip.pypa.io/en/stable/reference/installation-report/). ``--pin``
   requirements go to pip as constraints, so they steer the resolver without becoming roots.
   pip evaluates environment markers with the interpreter it runs in, not with ``--python-version``
   (pypa/pip#11010, pypa/pip#13296), so pip is run by an interpreter of the target's Python version
   when one is found here; either way the closure is walked again below with every
   ``Requires-Dist`` marker evaluated for the target (``packaging``), and a requirement the target
   needs but the report lacks is added as a root and the closure resolved again.
2. Leave out what the target already has: its ``pip list --format=freeze`` (or ``pip list`` table)
   output, compared by PEP 503 name. A package is left out when the target's version satisfies every
   specifier that the carried part of the closure puts on it; when it does not (sglang 0.5.17 pins
   ``transformers==5.12.1``, the target has 5.17.0) the package is carried and reported as a
   ``clash:`` line -- the wheelhouse goes first on PYTHONPATH, so the carried version wins
   (``--trust-target NAME`` keeps the target's instead). A name listed without a version counts as
   present at a version that satisfies (listed as unverified).
3. Leave out documented runtime-unused packages (name globs with a reason each; built-in defaults per
   engine version, below), and whatever is only needed by left-out packages (torch's CUDA wheels when
   the target has torch, tilelang's z3-solver when tilelang is left out).
4. Download the kept wheels (``pip download --no-deps --only-binary=:all:`` with the same target
   flags; files the index serves from a local ``file://`` mirror are copied), check each sha256 against
   the report, optionally repack kernel wheels without members the target never loads (RECORD
   rewritten, a build tag added to the file name so the copy is told apart from PyPI's), pack them into
   one deterministic tar split into ``<name>.tar.part-NNN`` files of at most ``--part-size`` (60 MiB by
   default), and write ``MANIFEST.json`` (parts, their sha256 and the whole tar's, kept / left-out /
   clash lists with reasons, the target) and ``install.sh``, which on the target checks the parts,
   reassembles and checks the tar, and runs ``python3 -m pip install --no-index --no-deps --target``.
5. ``stage`` puts one part (and install.sh, MANIFEST.json) into a folder that one transfer carries,
   so parts travel one call at a time.

Observed 2026-12 on an H200 (Python 3.12.3, torch 2.11.0+cu130, transformers 5.17.0, tokenizers
0.23.2 on the runner), with launches that served requests; these are the built-in defaults
(``ENGINE_DEFAULTS``; ``--no-defaults`` drops them, ``--keep NAME`` keeps one package):

- sglang 0.5.17 (upstream: sgl-project/sglang, ``python/pyproject.toml``; the facts below are read
  from the published wheels' ``Requires-Dist``): left out
  ``tokenspeed-*``, ``nvidia-cutlass-dsl*``, ``nvidia-nvvm``, ``nvidia-cuda-nvcc``,
  ``nvidia-cuda-cccl``, ``nvidia-cuda-crt``, ``nvidia-cuda-nvdisasm``, ``tilelang``, ``z3-solver``,
  ``nvidia-mathdx``, ``modelscope``, ``py-spy``, ``humming-kernels``, ``pyelftools``. It pins
  ``transformers==5.12.1`` (which needs ``tokenizers<=0.23.0``), so with the runner's transformers 5.17
  both ``transformers==5.12.1`` and ``tokenizers==0.22.2`` are carried (default pins). Its kernel wheel
  ``sglang-kernel==0.4.5`` is 383 MB, of which ``sgl_kernel/flash_ops.abi3.so`` (FA3) is 342 MB
  compressed and ``sgl_kernel/sm100/*`` 16 MB; on an H200 only ``sgl_kernel/sm90/common_ops`` loads, so
  ``--repack 'sglang-kernel:sgl_kernel/flash_ops.abi3.so,sgl_kernel/sm100/*'`` (H200 only: it breaks
  Blackwell and FA3) cuts it to 25.3 MB (measured on the built wheelhouse).
- vllm 0.26.0 (upstream: vllm-project/vllm, ``requirements/``; read from the published wheels'
  ``Requires-Dist``): left out ``tokenspeed-*``, ``nvidia-cutlass-dsl*``, ``nvidia-nvvm``,
  ``nvidia-cuda-nvcc``, ``nvidia-cuda-cccl``, ``nvidia-cuda-crt``, ``nvidia-cuda-nvdisasm``,
  ``tilelang``, ``pynvvideocodec``, ``z3-solver``, ``torchcodec``, ``fastsafetensors``,
  ``quack-kernels``, ``humming-kernels``. vllm pins ``apache-tvm-ffi==0.1.10`` while xgrammar 0.2.9
  (mlc-ai/xgrammar) requires ``apache-tvm-ffi>=0.1.11``; ``apache-tvm-ffi==0.1.11`` is carried instead
  (default override, applied after resolution and reported). pip alone settles the conflict by
  backtracking to xgrammar 0.2.7 (``>=0.1.10``), which 0.1.11 also satisfies.

Found by this module's own resolution (2026-12, not from a launch): mistral_common 1.13.1, in both
closures, requires ``numpy<2.4``, so numpy 2.3.5 is carried over the runner's 2.5.2 (a clash line);
``--trust-target numpy`` would keep the runner's.

    python -m kimi_perf.wheelhouse plan  --spec sglang==0.5.17 --python 3.12.3 \\
        --target-list h200-torch2.11-cu130
    python -m kimi_perf.wheelhouse build --spec sglang==0.5.17 --python 3.12.3 \\
        --target-list h200-torch2.11-cu130 \\
        --repack 'sglang-kernel:sgl_kernel/flash_ops.abi3.so,sgl_kernel/sm100/*' --out /work/wheelhouse/sglang
    python -m kimi_perf.wheelhouse stage --out /work/wheelhouse/sglang --part 0 --into .carry/wheelhouse

docs/wheelhouse.md has the walk-through.

The package has one concern per module, in the order the steps above run: ``target`` (the runner's
Python, platform tags and installed list), ``report`` (pip's installation report), ``rules``
(exclusions, pins, overrides, repack rules, the per-engine defaults), ``plan`` (the closure walk and
the carried / left-out verdicts), ``resolve`` (running pip for the target), ``repack`` (kernel wheels
without unused members), ``parts`` (the deterministic tar, its parts and install.sh), ``build``
(download, check, pack; staging one part) and ``cli``; ``_base`` holds the error type and constants
they share. Everything public is re-exported here, so ``from kimi_perf.wheelhouse import ...`` and
``python -m kimi_perf.wheelhouse ...`` are what they were when this was one module.
"""

from __future__ import annotations

from ._base import DEFAULT_PART_SIZE as DEFAULT_PART_SIZE
from ._base import DEFAULT_PLATFORMS as DEFAULT_PLATFORMS
from ._base import MIB as MIB
from ._base import TARGETS_DIR as TARGETS_DIR
from ._base import WheelhouseError, canonical_name
from .build import BuildResult as BuildResult
from .build import build, stage_part
from .build import download as download
from .cli import main
from .parts import PackResult, PartInfo, pack_parts, parse_part_size, split_file, write_install_sh
from .parts import glob_escape as glob_escape
from .plan import Plan, PlanEntry, Status, apply_overrides, make_plan
from .repack import RepackResult, repack_wheel
from .report import ResolvedPackage, parse_report
from .resolve import fetch_sizes as fetch_sizes
from .resolve import find_resolver_python as find_resolver_python
from .resolve import pip_report as pip_report
from .resolve import resolve_and_plan
from .rules import ENGINE_DEFAULTS, EngineDefaults, Exclusion, Override, RepackRule, defaults_for
from .target import InstalledPackage, TargetSpec, expand_platforms, parse_target_list
from .target import load_target_list as load_target_list

# __all__ is the public API, unchanged from the single module; the `X as X` imports keep the other names
# it offered reachable as attributes (kimi_perf.wheelhouse.MIB, .pip_report, ...)
__all__ = [
    "ENGINE_DEFAULTS",
    "EngineDefaults",
    "Exclusion",
    "InstalledPackage",
    "Override",
    "PackResult",
    "PartInfo",
    "Plan",
    "PlanEntry",
    "RepackResult",
    "RepackRule",
    "ResolvedPackage",
    "Status",
    "TargetSpec",
    "WheelhouseError",
    "apply_overrides",
    "build",
    "canonical_name",
    "defaults_for",
    "expand_platforms",
    "main",
    "make_plan",
    "pack_parts",
    "parse_part_size",
    "parse_report",
    "parse_target_list",
    "repack_wheel",
    "resolve_and_plan",
    "split_file",
    "stage_part",
    "write_install_sh",
]
