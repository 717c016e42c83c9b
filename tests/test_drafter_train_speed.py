"""benchmarks/drafter_train_speed.py end to end on a CPU: a recipe's cached samples in, one JSON with
the timed steps, the trainer's phases and the top ops out; and a clear refusal without samples.

Why a test: the script runs on GPU leases, which are short; it has to be known to work before one.
Here it runs on a tiny recipe of the embedded model whose samples are written into a temporary cache
(the script reads samples and never generates them; it extracts the stored features itself, as the
pipeline's feature stage would).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict
from pathlib import Path

import pytest
from engine_helpers import embedded_path

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
# draft vocabulary 2,048: past the samples' few hundred tokens it is filled with the lowest ids, common
# tokens, so some of the target's choices on random text are draftable and the loss is a real one
RECIPE = {"data": {"max_new_tokens": 32},
          "features": {"backend": "hf", "dtype": "float32", "device": "cpu"},
          "train": {"draft_vocab_size": 2048, "ttt_steps": 2, "epochs": 4, "batch_tokens": 128, "warmup_steps": 2}}


def _script():
    spec = importlib.util.spec_from_file_location("drafter_train_speed", ROOT / "benchmarks" / "drafter_train_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _profile(tmp_path: Path) -> Path:
    p = tmp_path / "tiny-recipe.json"
    p.write_text(json.dumps({"model": {"source": "embedded"}, "eagle3": {"recipe": RECIPE}}))
    return p


def _write_samples(tmp_path: Path, n_train: int = 8, n_held: int = 2) -> Path:
    from kimi_perf.eagle3.data import Sample
    from kimi_perf.eagle3.pipeline import DrafterRecipe, cache_dirs
    from kimi_perf.models.embedded import model_fingerprint

    data_dir, _, _ = cache_dirs(DrafterRecipe.from_dict(RECIPE), model_fingerprint(embedded_path()), tmp_path / "cache")
    data_dir.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    with open(data_dir / "samples.jsonl", "w") as f:
        for i in range(n_train + n_held):
            s = Sample(id=f"s{i:02d}", source="sharegpt", split="train" if i < n_train else "heldout",
                       prompt_ids=torch.randint(100, 40000, (12 + i,), generator=g).tolist(),
                       response_ids=torch.randint(100, 40000, (24,), generator=g).tolist())
            f.write(json.dumps(asdict(s)) + "\n")
    return data_dir


def test_the_benchmark_times_and_profiles_the_trainer(tmp_path):
    from kimi_perf.eagle3.pipeline import DrafterRecipe
    from kimi_perf.eagle3.shipped import recipe_key

    _write_samples(tmp_path)
    out = tmp_path / "report" / "speed.json"
    rc = _script().main(["--profile", str(_profile(tmp_path)), "--cache-root", str(tmp_path / "cache"),
                         "--max-samples", "6", "--steps", "3", "--warmup", "1", "--profile-steps", "2",
                         "--device", "cpu", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["recipe_digest"] == recipe_key(DrafterRecipe.from_dict(RECIPE)) and r["device"] == "cpu"
    assert r["train_samples"] == 6 and r["warmup_steps"] == 1 and r["batch_tokens"] == 128
    # the timed steps are steps 2-4 of the schedule, resumed from the warm-up's checkpoint
    assert r["steps"] == 3 and not r["schedule_end_reached"]
    assert r["tokens"] == r["trainer_tokens"] > 0 and r["padded_tokens"] >= r["tokens"]
    assert r["final_loss"] > 0  # the draft vocabulary holds some of the target's choices: a real loss
    assert r["tokens_per_s"] > 0 and r["ms_per_step"] == pytest.approx(1e3 * r["seconds"] / 3)
    assert r["torch"] == torch.__version__ and r["device_name"]
    # the trace: every labelled phase of the trainer's step, and the top ops by self CPU time
    assert r["profile_steps"] == 2 and "profile_error" not in r
    assert set(r["phases"]) == {"kimi:batch", "kimi:collate", "kimi:ttt_forward", "kimi:backward", "kimi:optimizer"}
    assert r["phases"]["kimi:ttt_forward"]["count"] == 2 and r["phases"]["kimi:ttt_forward"]["cpu_wall_ms"] > 0
    assert r["top_ops_by"] == "self_cpu_time" and 0 < len(r["top_ops"]) <= 25
    assert not any(o["name"].startswith("kimi:") for o in r["top_ops"])
    assert r["top_ops"][0]["self_cpu_ms"] >= r["top_ops"][-1]["self_cpu_ms"]


def test_the_benchmark_never_generates_samples(tmp_path):
    data_dir = _write_samples(tmp_path)
    (data_dir / "samples.jsonl").unlink()
    with pytest.raises(SystemExit, match=r"no generated samples at .*samples\.jsonl.*never generates"):
        _script().main(["--profile", str(_profile(tmp_path)), "--cache-root", str(tmp_path / "cache"),
                        "--out", str(tmp_path / "speed.json")])
    assert not (tmp_path / "speed.json").exists()


def test_the_stamped_loader_reads_the_lengths_once():
    """The wrapper times the trainer, so it must not add work of its own per batch: it once read the
    inner loader's ``lengths`` for every sample of every batch, and an online source built that dict
    on each read (8,000 samples on an H100: its batch phase took 1,145 ms of host time a step against
    32 ms of kernels, with the online source's per-sample copies)."""
    reads = []

    class Inner:
        @property
        def lengths(self):
            reads.append(1)
            return {"a": 5, "b": 9, "c": 3}

        def batch(self, ids, max_len):
            return list(ids)

    loader = _script()._StampedLoader(Inner(), torch.device("cpu"), None)
    for _ in range(20):
        assert loader.batch(["a", "b", "c"], 8) == ["a", "b", "c"]
    assert len(reads) == 1 and loader.lengths == {"a": 5, "b": 9, "c": 3}
    assert loader.batches == 20 and loader.tokens == 20 * (5 + 8 + 3) and loader.padded == 20 * 8 * 3
