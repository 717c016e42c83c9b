"""SGLang as a measured engine: command line per SGLang release, flag checks, and response parsing.

Why flag checks before launch: an SGLang launch on the Kimi-K2.5 profile costs ~10 minutes (weights +
CUDA-graph capture) before a misspelt or removed flag is reported, if at all (argparse prefix matching
makes ``--cuda-graph-max-bs`` *ambiguous* in 0.5.23, not unknown). Removed and renamed flags are
rejected here with the replacement named; CI additionally parses every command line the suite builds
with the real ``sglang==0.5.23`` ``ServerArgs`` parser and its model-independent validation
(tests/test_engine_configs.py, :mod:`kimi_perf.engines.argv_check`).

Why per-release tables: the suite drives more than one SGLang. 0.5.23 is what CI's parser environment
has; 0.5.17 is the newest release that matches the H200's torch 2.11. They differ in exactly the flags
the suite renders: 0.5.17 still accepts ``--cuda-graph-max-bs`` (a deprecated alias of
``--cuda-graph-max-bs-decode``) and has no capture-only aux mode (``--enable-return-aux-hidden-states``
and ``--return-aux-hidden-state-layer-ids`` arrived later). Each table below was read off that
release's parser (``ServerArgs.add_cli_args`` in python/sglang/srt/server_args.py: the option strings
and their ``Deprecated*Action`` classes).

Hidden-state and speculative responses share the reference engine's parsers (SGLang's layout is the
reference engine's), see :mod:`kimi_perf.alignment.extract` and :mod:`kimi_perf.eagle3.evaluate`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..launcher import LaunchSpec
from .base import EngineConfig, SpecConfig
from .presets import nccl_env

__all__ = ["SGLANG_DEFAULT_VERSION", "SGLANG_FLAGS", "SGLANG_REMOVED_FLAGS", "SGLangConfig",
           "SGLangFlagError", "SGLangFlags", "check_sglang_flags", "parse_generate_response",
           "server_info_accept_length"]


@dataclass(frozen=True)
class SGLangFlags:
    """What one SGLang release's launcher accepts, for the flags this suite renders or users pass.

    ``removed``: flag -> (replacement or None, why) -- rejected before launch. ``deprecated``: flag ->
    advice -- accepted by SGLang with a warning, surfaced by :class:`SGLangConfig`.
    """

    version: str
    removed: Mapping[str, tuple[str | None, str]]
    deprecated: Mapping[str, str]
    aux_mode: bool  # --enable-return-aux-hidden-states / --return-aux-hidden-state-layer-ids exist
    sampling_backends: tuple[str, ...]


_DISABLE_CUDA_GRAPH = ("deprecated (DeprecatedStoreTrueAction, still accepted and still read by adaptive "
                       "speculative decoding): SGLang names --cuda-graph-backend-{decode,prefill}=disabled; "
                       "--disable-decode-cuda-graph --disable-prefill-cuda-graph are its per-phase spellings")
_NO_AUX_0_5_17 = ("SGLang 0.5.17 has no capture-only aux mode: serve the drafter with "
                  "--speculative-algorithm EAGLE3 and request return_hidden_states (the rows are then its "
                  "aux layers), or use 0.5.23")

SGLANG_FLAGS: Mapping[str, SGLangFlags] = {
    "0.5.23": SGLangFlags(
        version="0.5.23",
        removed={
            "--cuda-graph-max-bs": ("--cuda-graph-max-bs-decode",
                                    "split into -decode/-prefill in 0.5.23 (now ambiguous)"),
            "--cuda-graph-bs": ("--cuda-graph-bs-decode",
                                "split into -decode/-prefill in 0.5.23 (now ambiguous)"),
            "--return-hidden-states": ("--enable-return-hidden-states",
                                       "server flag is --enable-return-hidden-states; the request field is "
                                       "return_hidden_states"),
        },
        deprecated={"--disable-cuda-graph": _DISABLE_CUDA_GRAPH},
        aux_mode=True,
        sampling_backends=("flashinfer", "pytorch", "ascend", "intel_xpu"),
    ),
    "0.5.17": SGLangFlags(
        version="0.5.17",
        removed={
            "--return-hidden-states": ("--enable-return-hidden-states",
                                       "server flag is --enable-return-hidden-states; the request field is "
                                       "return_hidden_states"),
            "--enable-return-aux-hidden-states": (None, _NO_AUX_0_5_17),
            "--return-aux-hidden-state-layer-ids": (None, _NO_AUX_0_5_17),
        },
        deprecated={
            "--cuda-graph-max-bs": ("deprecated alias of --cuda-graph-max-bs-decode in 0.5.17 "
                                    "(removed in 0.5.23)"),
            "--cuda-graph-bs": "deprecated alias of --cuda-graph-bs-decode in 0.5.17 (removed in 0.5.23)",
            "--disable-cuda-graph": _DISABLE_CUDA_GRAPH,
        },
        aux_mode=False,
        sampling_backends=("flashinfer", "pytorch", "ascend"),
    ),
}
SGLANG_DEFAULT_VERSION = "0.5.23"
# the 0.5.23 table under its historical name (CI checks it against the 0.5.23 parser)
SGLANG_REMOVED_FLAGS = SGLANG_FLAGS["0.5.23"].removed


class SGLangFlagError(ValueError):
    pass


def _flags(version: str) -> SGLangFlags:
    if version not in SGLANG_FLAGS:
        raise SGLangFlagError(f"SGLang version {version!r} has no flag table here; supported: "
                              f"{', '.join(sorted(SGLANG_FLAGS))} (read the new release's "
                              "ServerArgs.add_cli_args and add a table in kimi_perf/engines/sglang.py)")
    return SGLANG_FLAGS[version]


def check_sglang_flags(argv: Sequence[str], version: str = SGLANG_DEFAULT_VERSION) -> list[str]:
    """Raise for flags ``version`` does not accept (naming the replacement); return warnings for the
    deprecated ones it still accepts."""
    t = _flags(version)
    problems, warnings = [], []
    for a in argv:
        flag = a.split("=", 1)[0]
        if flag in t.removed:
            new, why = t.removed[flag]
            problems.append(f"{flag} is not accepted by SGLang {version} ({why})"
                            + (f": use {new}" if new else ""))
        elif flag in t.deprecated:
            warnings.append(f"{flag}: SGLang {version}: {t.deprecated[flag]}")
    if problems:
        raise SGLangFlagError("; ".join(problems))
    return warnings


@dataclass(frozen=True)
class SGLangConfig(EngineConfig):
    kind: ClassVar[str] = "sglang"
    version: str = SGLANG_DEFAULT_VERSION  # the SGLang release the interpreter runs: picks the flag table
    tp_size: int = 1
    dtype: str = "auto"
    load_format: str = "auto"
    random_seed: int = 0  # SGLang draws a random seed when unset: always pinned here
    context_length: int | None = None
    mem_fraction_static: float | None = None
    attention_backend: str | None = None
    sampling_backend: str | None = None  # --sampling-backend; the H200 runs use "pytorch"
    cuda_graph_max_bs_decode: int | None = None
    disable_cuda_graph: bool = False
    num_continuous_decode_steps: int | None = None
    disable_custom_all_reduce: bool = False
    # --sleep-on-idle: without it an idle SGLang scheduler loops without sleeping (0.5.17/0.5.23
    # Scheduler.maybe_sleep_on_idle is a no-op unless ServerArgs.sleep_on_idle). In a same-run A/B the
    # side not being measured is idle, so its spinning scheduler takes a host CPU from the side that is
    # (docs/ab-gate.md, "SGLang on one GPU")
    sleep_on_idle: bool = False
    enable_metrics: bool = True
    spec: SpecConfig | None = None
    return_hidden_states: bool = False
    aux_hidden_states: bool = False
    aux_layer_ids: tuple[int, ...] | None = None
    disable_radix_cache: bool = False
    chunked_prefill_size: int | None = None
    trust_remote_code: bool = False
    nccl_preset: str | None = None

    def __post_init__(self) -> None:
        # Invalid combinations fail here, when the profile is read, not ten minutes into a launch.
        t = _flags(self.version)
        if self.aux_hidden_states and not t.aux_mode:
            raise SGLangFlagError(f"aux_hidden_states: {_NO_AUX_0_5_17} (set return_hidden_states with spec, "
                                  "or version '0.5.23')")
        if self.aux_hidden_states and self.spec is not None:
            # sglang 0.5.23 python/sglang/srt/arg_groups/validation_hook.py handle_aux_hidden_state_capture
            raise SGLangFlagError(
                "aux_hidden_states with spec: SGLang rejects --enable-return-aux-hidden-states together "
                "with --speculative-draft-model-path (aux mode captures without a draft). To read a served "
                "drafter's aux layers, keep spec and set return_hidden_states instead (rows are then the "
                "drafter's aux layers); for capture without a drafter, drop spec")
        if self.aux_layer_ids is not None and not self.aux_hidden_states:
            raise SGLangFlagError("aux_layer_ids needs aux_hidden_states (SGLang rejects "
                                  "--return-aux-hidden-state-layer-ids without "
                                  "--enable-return-aux-hidden-states)")
        if self.aux_layer_ids is not None and (not self.aux_layer_ids or min(self.aux_layer_ids) < 0
                                               or len(set(self.aux_layer_ids)) != len(self.aux_layer_ids)):
            raise SGLangFlagError(f"aux_layer_ids {list(self.aux_layer_ids)}: SGLang needs a non-empty "
                                  "list of distinct non-negative ids")
        if self.sampling_backend is not None and self.sampling_backend not in t.sampling_backends:
            raise SGLangFlagError(f"sampling_backend {self.sampling_backend!r} is not a choice of SGLang "
                                  f"{self.version}: {', '.join(t.sampling_backends)}")
        self.flag_warnings()  # removed flags (extra_args included) raise now

    def _render(self, port: int) -> list[str]:
        a = [self.python, "-m", "sglang.launch_server", "--model-path", self.model_path,
             "--served-model-name", self.served_model_name, "--host", self.host, "--port", str(port),
             "--tp-size", str(self.tp_size), "--dtype", self.dtype, "--load-format", self.load_format,
             "--random-seed", str(self.random_seed)]
        if self.context_length:
            a += ["--context-length", str(self.context_length)]
        if self.mem_fraction_static is not None:
            a += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.attention_backend:
            a += ["--attention-backend", self.attention_backend]
        if self.sampling_backend:
            a += ["--sampling-backend", self.sampling_backend]
        if self.cuda_graph_max_bs_decode:
            # exists in 0.5.17 and 0.5.23 (0.5.17's --cuda-graph-max-bs is its deprecated alias)
            a += ["--cuda-graph-max-bs-decode", str(self.cuda_graph_max_bs_decode)]
        if self.disable_cuda_graph:
            # kept over the per-phase pair: SGLang still reads the legacy field (adaptive spec decoding)
            a.append("--disable-cuda-graph")
        if self.num_continuous_decode_steps:
            a += ["--num-continuous-decode-steps", str(self.num_continuous_decode_steps)]
        if self.disable_custom_all_reduce:
            a.append("--disable-custom-all-reduce")
        if self.sleep_on_idle:
            a.append("--sleep-on-idle")
        if self.enable_metrics:
            a.append("--enable-metrics")
        if self.spec is not None:
            a += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", self.spec.draft_model_path,
                  "--speculative-num-steps", str(self.spec.steps), "--speculative-eagle-topk", str(self.spec.topk),
                  "--speculative-num-draft-tokens", str(self.spec.num_draft_tokens)]
        if self.return_hidden_states or self.aux_hidden_states:
            # hidden states are only complete without prefix reuse and with one prefill chunk: a radix hit
            # or a later chunk returns rows for the uncached/last part only
            a += ["--disable-radix-cache", "--chunked-prefill-size", "-1"]
        elif self.disable_radix_cache:
            a.append("--disable-radix-cache")
        full_prefill = self.return_hidden_states or self.aux_hidden_states
        if self.chunked_prefill_size is not None and not full_prefill:
            a += ["--chunked-prefill-size", str(self.chunked_prefill_size)]
        if self.return_hidden_states:
            a.append("--enable-return-hidden-states")
        if self.aux_hidden_states:
            a.append("--enable-return-aux-hidden-states")
            # aux mode needs the EAGLE3 algorithm flag to name the capture convention (no drafter loaded:
            # __post_init__ refuses spec here)
            a += ["--speculative-algorithm", "EAGLE3"]
            if self.aux_layer_ids is not None:
                a += ["--return-aux-hidden-state-layer-ids", *map(str, self.aux_layer_ids)]
        if self.trust_remote_code:
            a.append("--trust-remote-code")
        return a + list(self.extra_args)

    def argv(self, port: int) -> list[str]:
        a = self._render(port)
        check_sglang_flags(a, self.version)
        return a

    def flag_warnings(self) -> list[str]:
        """Deprecation warnings for this command line on ``version`` (SGLang prints them at startup, into
        a log nobody reads before the ten-minute load is over)."""
        return check_sglang_flags(self._render(0), self.version)

    def environ(self) -> dict[str, str]:
        return {**nccl_env(self.nccl_preset), **dict(self.env)}

    def launch_spec(self, log_dir: Path) -> LaunchSpec:
        # Launch time is where a deprecated flag still matters: say so in the session's progress lines.
        from ..progress import log

        for w in self.flag_warnings():
            log(f"{self.name}: {w}")
        return super().launch_spec(log_dir)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "version": self.version, "flag_warnings": self.flag_warnings()}


def parse_generate_response(body: str | dict[str, Any] | list[Any]) -> list[dict[str, Any]]:
    """Normalise an SGLang ``/generate`` response (one object or a batch list) into records with the
    fields the suite uses, validating the documented shape.

    The spec fields are what sglang 0.5.17 python/sglang/srt/managers/tokenizer_manager.py
    ``TokenizerManager._calculate_spec_decoding_metrics`` adds on the finished response of a
    speculative server: ``spec_verify_ct`` (verify steps; the prefill step is not one),
    ``spec_num_correct_drafts`` (accepted draft tokens, no bonus), ``spec_num_proposed_drafts``
    (= verify steps x (num_draft_tokens - 1)), ``spec_accept_length`` (= completion_tokens /
    spec_verify_ct, which counts the prefill's token too) and ``spec_correct_drafts_histogram``
    (index k = verify steps that accepted exactly k drafts).
    """
    data = json.loads(body) if isinstance(body, str) else body
    items = data if isinstance(data, list) else [data]
    out = []
    for i, d in enumerate(items):
        if not isinstance(d, dict) or "meta_info" not in d:
            raise ValueError(f"/generate item {i}: no meta_info (got keys {sorted(d) if isinstance(d, dict) else type(d).__name__})")
        m = d["meta_info"]
        for k in ("prompt_tokens", "completion_tokens"):
            if not isinstance(m.get(k), int):
                raise ValueError(f"/generate item {i}: meta_info.{k} missing or not an integer")
        rec = {"text": d.get("text"), "output_ids": d.get("output_ids"), "prompt_tokens": m["prompt_tokens"],
               "completion_tokens": m["completion_tokens"], "e2e_latency": m.get("e2e_latency"),
               "finish_reason": m.get("finish_reason")}
        if "spec_verify_ct" in m:
            ver = int(m["spec_verify_ct"])
            hist = m.get("spec_correct_drafts_histogram", m.get("spec_accept_histogram"))
            rec.update(spec_verify_ct=ver, spec_accept_length=m.get("spec_accept_length",
                       (m["completion_tokens"] / ver) if ver else None),
                       spec_accept_rate=m.get("spec_accept_rate"),
                       spec_num_correct_drafts=m.get("spec_num_correct_drafts",
                                                     m.get("spec_accepted_drafts")),
                       spec_num_proposed_drafts=m.get("spec_num_proposed_drafts",
                                                      m.get("spec_proposed_drafts")),
                       spec_correct_drafts_histogram=list(hist) if hist is not None else None)
        out.append(rec)
    return out


def server_info_accept_length(info: dict[str, Any]) -> float | None:
    """``/server_info`` -> ``internal_states[0].avg_spec_accept_length`` (None when absent).

    sglang 0.5.17 managers/scheduler.py ``Scheduler.get_internal_state`` reports it only once a verify
    step was counted since the last ``/flush_cache`` (which resets the counters), as
    accepted-plus-one tokens per verify step; the counters are folded in every ``decode_log_interval``
    (40) decode steps (scheduler_components/metrics_reporter.py ``report_decode_stats``), so the
    window lags the last < 40 steps.
    """
    st = info.get("internal_states") or []
    if st and isinstance(st[0], dict) and st[0].get("avg_spec_accept_length") is not None:
        return float(st[0]["avg_spec_accept_length"])
    return None
