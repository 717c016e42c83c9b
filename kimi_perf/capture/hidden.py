"""Hidden states with provenance, and the transformers extractor that produces them.

Why a module of its own: this is the layer both sides build on. The alignment extractors and
comparisons (:mod:`kimi_perf.alignment.extract`) wrap every captured tensor in these types, and the
EAGLE-3 feature capture (:mod:`kimi_perf.eagle3.features`, backend ``hf``) runs :class:`HFExtractor`.
While it lived in ``extract``, that module and ``eagle3.features`` imported each other (lazily, so
nothing failed, but neither could be loaded or tested without the other); now ``extract`` reads stored
features from ``eagle3.features`` and ``eagle3.features`` imports only this module.

torch and transformers are imported inside :class:`HFExtractor`, so the types load without them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["AlignmentSetupError", "HFExtractor", "HiddenStates", "Layer", "Provenance"]

Layer = int | str


class AlignmentSetupError(RuntimeError):
    """A side cannot provide what was asked (missing flag, layer, feature set); the message says the fix."""


@dataclass(frozen=True)
class Provenance:
    backend: str
    version: str
    dtype: str
    positions: tuple[int, int]  # [start, end) of the token positions covered
    layer_convention: str = "residual stream entering layer k; 'final' = final-norm output"
    note: str = ""


@dataclass(frozen=True)
class HiddenStates:
    layers: dict[Layer, np.ndarray]  # layer -> [T, H] float32
    token_ids: tuple[int, ...]  # input token at each covered position
    provenance: Provenance
    output_ids: tuple[int, ...] = field(default_factory=tuple)
    # rows [0, prompt_len) are the prompt's, the rest fed-back generated tokens (None: not known)
    prompt_len: int | None = None

    def get(self, layer: Layer) -> np.ndarray:
        if layer not in self.layers:
            have = ", ".join(str(k) for k in self.layers)
            raise AlignmentSetupError(f"{self.provenance.backend} provides layers [{have}], not {layer}")
        return self.layers[layer]


class HFExtractor:
    """transformers forward over a whole sequence; hooks capture the input of each decoder layer."""

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32", device: str = "cpu") -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.dtype = dtype
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
        self.model = model.to(device).eval()  # type: ignore[arg-type]  # transformers' stub types .to oddly
        self.device = device
        self.version = f"transformers {transformers.__version__}"
        self.num_layers = int(self.model.config.num_hidden_layers)
        self._cap: dict[int, Any] = {}
        inner = self.model.model
        for k in range(self.num_layers + 1):
            mod = inner.layers[k] if k < self.num_layers else inner.norm

            def hook(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any], _k: int = k) -> None:
                if _k in self._want:
                    self._cap[_k] = (args[0] if args else kwargs["hidden_states"]).detach()

            mod.register_forward_pre_hook(hook, with_kwargs=True)
        self._want: set[int] = set()

    @property
    def final_norm_weight(self) -> np.ndarray:
        return self.model.model.norm.weight.detach().float().cpu().numpy()

    def __call__(self, ids: Sequence[int], layers: Sequence[Layer]) -> tuple[dict[Layer, Any], Any]:
        """Torch tensors per layer ([T, H], model dtype) and the logits' argmax [T]: a batch of one
        (no padding, so the same forward as before batches existed)."""
        return self.batch([ids], layers)[0]

    def batch(self, seqs: Sequence[Sequence[int]], layers: Sequence[Layer]) -> list[tuple[dict[Layer, Any], Any]]:
        """What ``self(ids, layers)`` gives for each of ``seqs``, from one right-padded forward.

        Right padding leaves every real token's position ids (0..len-1, transformers' default) and
        its causal context unchanged; the attention mask only keeps padded keys out of the padded
        rows, which are dropped. What can differ from one forward per sequence is the kernels'
        summation order for another matrix shape: fp32 rows agree to ~1e-5
        (tests/test_resume.py checks it), bf16 rows to bf16 rounding."""
        torch = self.torch
        self._want = {k for k in layers if isinstance(k, int)}
        self._cap.clear()
        lens = [len(s) for s in seqs]
        width = max(lens)
        x = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros_like(x)
        for i, s in enumerate(seqs):
            x[i, : len(s)] = torch.tensor(list(s))
            mask[i, : len(s)] = 1
        with torch.inference_mode():
            out = self.model(x.to(self.device), attention_mask=mask.to(self.device),
                             output_hidden_states="final" in layers)
            argmax = out.logits.argmax(-1)
        res = []
        for i, n in enumerate(lens):
            t: dict[Layer, Any] = {k: self._cap[k][i, :n] for k in layers if isinstance(k, int)}
            if "final" in layers:
                t["final"] = out.hidden_states[-1][i, :n]
            res.append((t, argmax[i, :n]))
        return res

    def hidden_states(self, ids: Sequence[int], layers: Sequence[Layer]) -> HiddenStates:
        t, _ = self(ids, layers)
        return HiddenStates({k: v.float().cpu().numpy() for k, v in t.items()}, tuple(ids),
                            Provenance("hf-offline", self.version, self.dtype, (0, len(ids)),
                                       note="one full-sequence forward, no KV cache"))
