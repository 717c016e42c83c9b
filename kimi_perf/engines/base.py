"""Engine configurations: frozen dataclasses that render a command line and an environment.

Why: the launch *is* part of what is measured (a flag or an NCCL variable moves throughput), so it must
be data that is compared, stored next to results and checked before launch -- not a string someone
edits. Each engine runs with its own interpreter (``python``), because SGLang, vLLM and the suite
live in separate environments with conflicting pins.
"""

from __future__ import annotations

import abc
import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..launcher import LaunchSpec

__all__ = ["EngineConfig", "ReferenceEngineConfig", "SpecConfig"]


@dataclass(frozen=True)
class SpecConfig:
    """EAGLE-3 chain drafting: ``steps`` drafts per verify, topk 1, ``steps + 1`` tokens verified."""

    draft_model_path: str
    steps: int = 3
    topk: int = 1

    @property
    def num_draft_tokens(self) -> int:
        return self.steps + 1


@dataclass(frozen=True)
class EngineConfig(abc.ABC):
    kind: ClassVar[str] = "base"
    name: str
    model_path: str
    python: str = sys.executable
    host: str = "127.0.0.1"
    served_model_name: str = "model"
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    ready_timeout_s: float = 600.0
    health_path: str = "/health"
    # CPU affinity of the server process tree, () = inherited. Set by the A/B runner's CPU plan
    # (ab.pin_cpus), never from a profile: which cores exist is the runner's, not the profile's
    cpus: tuple[int, ...] = ()

    @abc.abstractmethod
    def argv(self, port: int) -> list[str]:
        """The command line for a server on ``port``."""

    def environ(self) -> dict[str, str]:
        return dict(self.env)

    def launch_spec(self, log_dir: Path) -> LaunchSpec:
        return LaunchSpec(name=self.name, argv_for_port=self.argv, env=self.environ(), host=self.host,
                          health_path=self.health_path, ready_timeout_s=self.ready_timeout_s, log_dir=log_dir,
                          cpus=self.cpus)

    def describe(self) -> dict[str, Any]:
        d = {"kind": self.kind, "name": self.name, "argv": self.argv(0), "env": self.environ()}
        return {**d, "cpus": list(self.cpus)} if self.cpus else d


@dataclass(frozen=True)
class ReferenceEngineConfig(EngineConfig):
    kind: ClassVar[str] = "reference"
    dtype: str = "bfloat16"
    device: str = "auto"
    load_format: str = "auto"
    context_length: int = 1024
    max_running_requests: int = 16
    max_prefill_tokens: int = 4096
    prefill_wait_ms: float | None = None  # None: the server's default (20 ms)
    random_seed: int = 0
    torch_threads: int = 0
    spec: SpecConfig | None = None
    return_hidden_states: bool = False
    aux_hidden_states: bool = False
    aux_layer_ids: tuple[int | str, ...] | None = None  # "final" = final-norm output
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 128
    # the kimi_perf source tree the server runs from; None = this checkout. Set only by the A/B base
    # side (--perf-ab git:REF, a worktree of another commit), never from a profile
    source_root: str | None = None

    def argv(self, port: int) -> list[str]:
        a = [
            self.python, "-m", "kimi_perf.engines.reference.server",
            "--model-path", self.model_path, "--served-model-name", self.served_model_name,
            "--host", self.host, "--port", str(port), "--dtype", self.dtype, "--device", self.device,
            "--load-format", self.load_format, "--context-length", str(self.context_length),
            "--max-running-requests", str(self.max_running_requests),
            "--max-prefill-tokens", str(self.max_prefill_tokens), "--random-seed", str(self.random_seed),
        ]
        if self.torch_threads:
            a += ["--torch-threads", str(self.torch_threads)]
        if self.prefill_wait_ms is not None:
            a += ["--prefill-wait-ms", str(self.prefill_wait_ms)]
        if self.spec is not None:
            a += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", self.spec.draft_model_path,
                  "--speculative-num-steps", str(self.spec.steps), "--speculative-eagle-topk", str(self.spec.topk),
                  "--speculative-num-draft-tokens", str(self.spec.num_draft_tokens)]
        if self.return_hidden_states:
            a.append("--enable-return-hidden-states")
        if self.aux_hidden_states:
            a.append("--enable-return-aux-hidden-states")
        if self.aux_layer_ids is not None:
            a += ["--return-aux-hidden-state-layer-ids", ",".join(str(i) for i in self.aux_layer_ids)]
        if self.disable_cuda_graph:
            a.append("--disable-cuda-graph")
        else:
            a += ["--cuda-graph-max-bs-decode", str(self.cuda_graph_max_bs)]
        return a + list(self.extra_args)

    def launch_spec(self, log_dir: Path) -> LaunchSpec:
        # `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH: a server that
        # must run another source tree (the A/B base's worktree) has to start inside it
        spec = super().launch_spec(log_dir)
        return dataclasses.replace(spec, cwd=self.source_root) if self.source_root else spec

    def environ(self) -> dict[str, str]:
        # the engine imports kimi_perf from this checkout (or the A/B base's worktree) even when it is
        # not pip-installed; PYTHONPATH comes before site-packages, so it also wins over an install
        root = self.source_root or str(Path(__file__).resolve().parents[2])
        pp = os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH", "")) if x)
        return {"PYTHONPATH": pp, **dict(self.env)}
