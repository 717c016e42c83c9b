"""Parse command lines with an engine's *real* argument parser, inside that engine's environment.

Why: a launch that dies on a misspelt flag after ten minutes of weight loading is the most expensive
typo in serving. CI runs ``<engine env python> -m kimi_perf.engines.argv_check {sglang|vllm}`` with the
suite's rendered argv lists as JSON on stdin (only ``kimi_perf/__init__`` is imported besides the
engine), and gets one verdict per argv back as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys


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


def check(engine: str, argvs: list[list[str]]) -> list[dict[str, object]]:
    p = _parser(engine)
    out = []
    for argv in argvs:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ns = p.parse_args(argv)
            out.append({"ok": True, "parsed": {k: v for k, v in vars(ns).items()
                                                if isinstance(v, (str, int, float, bool, list, type(None)))}})
        except SystemExit:
            lines = [ln for ln in err.getvalue().strip().splitlines() if ln.strip()]
            out.append({"ok": False, "error": lines[-1] if lines else "argparse exit"})
    return out


if __name__ == "__main__":
    print(json.dumps(check(sys.argv[1], json.load(sys.stdin)), default=str))
