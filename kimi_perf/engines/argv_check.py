"""Parse command lines with an engine's *real* argument parser, inside that engine's environment.

Why: a launch that dies on a misspelt flag after ten minutes of weight loading is the most expensive
typo in serving. CI runs ``<engine env python> -m kimi_perf.engines.argv_check {sglang|vllm}`` with the
suite's rendered argv lists as JSON on stdin (only ``kimi_perf/__init__`` is imported besides the
engine), and gets one verdict per argv back as JSON.

Why SGLang needs more than argparse: some invalid combinations are accepted by the parser and
rejected by ``ServerArgs``'s validation when the server starts (sglang 0.5.23: aux mode with a draft
model, in python/sglang/srt/arg_groups/validation_hook.py ``handle_aux_hidden_state_capture``). So each
parsed namespace is also turned into ``ServerArgs.from_cli_args(ns)`` and validated -- the
model-independent part only: ``model_path`` is replaced by ``"dummy"``, SGLang's own short circuit
(0.5.23 arg_groups/pipeline.py ``run_resolution_pipeline``; 0.5.17 ``ServerArgs.__post_init__``) after
which only checkpoint- and GPU-dependent handlers remain. The CPU parser environment lacks some
imports the full pipeline wants (transformers for model configs); then the hooks before the
short circuit are run one by one, in SGLang's order, read from the pipeline's source, and every hook
that cannot be imported is reported by name with the reason. A verdict always says what validation
ran ("validation"), never a bare ok.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import io
import json
import re
import sys
from typing import Any

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _parser(engine: str) -> argparse.ArgumentParser:
    if engine == "sglang":
        from sglang.srt.server_args import ServerArgs

        p = argparse.ArgumentParser(prog="sglang serve")
        ServerArgs.add_cli_args(p)
        return p
    if engine == "vllm":
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        return make_arg_parser(FlexibleArgumentParser())
    raise SystemExit(f"unknown engine {engine!r}: sglang or vllm")


def _pre_dummy_hooks() -> list[tuple[str, str]]:
    """(hook name, module) of every ``run_hook(...)`` in SGLang's ``run_resolution_pipeline`` before its
    dummy-model return, in order, read from the source (importing the pipeline is what fails)."""
    spec = importlib.util.find_spec("sglang.srt.arg_groups.pipeline")
    if spec is None or not spec.origin:
        return []
    with open(spec.origin) as f:
        tree = ast.parse(f.read())
    fn = next((n for n in tree.body
               if isinstance(n, ast.FunctionDef) and n.name == "run_resolution_pipeline"), None)
    if fn is None:
        return []
    where: dict[str, str] = {}
    for n in tree.body:
        if isinstance(n, ast.ImportFrom) and n.module:
            for a in n.names:
                where[a.asname or a.name] = n.module
    hooks = []
    for st in fn.body:
        if isinstance(st, ast.ImportFrom) and st.module:
            for a in st.names:
                where[a.asname or a.name] = st.module
        elif isinstance(st, ast.If) and "dummy" in ast.unparse(st.test):
            break
        elif (isinstance(st, ast.Expr) and isinstance(st.value, ast.Call)
              and ast.unparse(st.value.func) == "run_hook" and st.value.args):
            name = ast.unparse(st.value.args[0])
            if name in where:
                hooks.append((name, where[name]))
    return hooks


def _sglang_validate(ns: argparse.Namespace) -> dict[str, Any]:
    """ServerArgs validation of one parsed namespace, model-independent part; see the module docstring."""
    from sglang.srt.server_args import ServerArgs

    ns = argparse.Namespace(**vars(ns))
    ns.model_path = "dummy"
    try:
        sa = ServerArgs.from_cli_args(ns)  # 0.5.17: __post_init__ validates here, up to its dummy return
    except ValueError as e:
        return {"ok": False, "error": f"ServerArgs validation: {e}", "validation": "ServerArgs"}
    except Exception as e:  # noqa: BLE001 - reported, not swallowed: the verdict says it did not run
        return {"validation": f"not run: ServerArgs.from_cli_args raised {type(e).__name__}: {e}"}
    if not hasattr(sa, "resolve_once"):
        return {"validation": "ServerArgs.__post_init__ up to its dummy-model return"}
    try:
        sa.resolve_once()
        return {"validation": "ServerArgs.resolve_once (model-independent hooks: model_path 'dummy')"}
    except ValueError as e:
        return {"ok": False, "error": f"ServerArgs validation: {e}", "validation": "ServerArgs.resolve_once"}
    except ImportError as e:
        why = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - as above
        return {"validation": f"not run: ServerArgs.resolve_once raised {type(e).__name__}: {e}"}
    # The full pipeline cannot be imported here: run the model-independent hooks one by one.
    hooks = _pre_dummy_hooks()
    if not hooks:
        return {"validation": f"not run: {why}; no run_resolution_pipeline hooks found in this SGLang"}
    try:
        from sglang.srt.arg_groups.resolution_hooks import run_hook
    except ImportError:
        def run_hook(h: Any, s: Any) -> Any:
            return h(s)
    sa = ServerArgs.from_cli_args(ns)
    ran: list[str] = []
    not_run = {"run_resolution_pipeline": why}
    for name, mod in hooks:
        try:
            fn = getattr(importlib.import_module(mod), name)
        except ImportError as e:
            not_run[name] = f"{type(e).__name__}: {e}"
            continue
        try:
            run_hook(fn, sa)
        except ValueError as e:
            return {"ok": False, "error": f"ServerArgs validation ({name}): {e}", "validation": "partial",
                    "validation_ran": ran + [name], "validation_not_run": not_run}
        except Exception as e:  # noqa: BLE001 - e.g. a platform probe on this CPU box: named, not swallowed
            not_run[name] = f"raised {type(e).__name__}: {e}"
            continue
        ran.append(name)
    return {"validation": "partial", "validation_ran": ran, "validation_not_run": not_run}


def check(engine: str, argvs: list[list[str]]) -> list[dict[str, object]]:
    p = _parser(engine)
    out: list[dict[str, object]] = []
    for argv in argvs:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
                ns = p.parse_args(argv)
        except SystemExit:
            lines = [ln for ln in err.getvalue().strip().splitlines() if ln.strip()]
            out.append({"ok": False, "error": lines[-1] if lines else "argparse exit"})
            continue
        # Deprecated-alias actions print their warning while parsing: keep them in the verdict.
        warnings = [_ANSI.sub("", ln).strip() for ln in err.getvalue().splitlines()
                    if "deprecat" in ln.lower()]
        verdict: dict[str, object] = {
            "ok": True, "warnings": warnings,
            "parsed": {k: v for k, v in vars(ns).items()
                       if isinstance(v, (str, int, float, bool, list, type(None)))}}
        if engine == "sglang":
            with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                verdict.update(_sglang_validate(ns))
        else:
            verdict["validation"] = "not run: argparse only (vLLM's EngineArgs checks need the model config)"
        out.append(verdict)
    return out


if __name__ == "__main__":
    print(json.dumps(check(sys.argv[1], json.load(sys.stdin)), default=str))
