"""The ``http-aux`` feature backend against a real server: the reference engine in aux mode answers in
SGLang's layout, so the backend's request, layer naming and row count are exercised end to end on the
CPU (on a GPU runner the same backend reads SGLang 0.5.17 serving EAGLE-3; tests/test_sglang_adapter.py
checks that layout against a recorded response). Its features must equal the in-process reference
backend's, which runs the same engine code without HTTP."""

from __future__ import annotations

import sys

import pytest
from engine_helpers import chat_ids

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def aux_server(model_dir, tmp_path_factory):
    from kimi_perf.engines.base import ReferenceEngineConfig
    from kimi_perf.launcher import ServerProcess

    cfg = ReferenceEngineConfig(name="ref-aux-fp32", model_path=str(model_dir), served_model_name="smol",
                                python=sys.executable, dtype="float32", device="cpu", context_length=512,
                                max_running_requests=4, disable_cuda_graph=True, aux_hidden_states=True,
                                aux_layer_ids=(2, 15, 27))
    proc = ServerProcess(cfg.launch_spec(tmp_path_factory.mktemp("logs"))).start()  # returns once ready
    yield proc
    proc.stop()


def test_http_aux_features_equal_the_in_process_reference_backend(aux_server, model_dir, tok):
    from kimi_perf.eagle3.features import FeaturePath, FeatureSpec

    ids = chat_ids(tok, "Name three primes and say why each is prime.")[:48]
    http = FeaturePath(FeatureSpec(backend="http-aux", dtype="float32", server_url=aux_server.base_url), model_dir)
    local = FeaturePath(FeatureSpec(backend="reference", dtype="float32"), model_dir)
    assert "aux mode" in http.version
    aux_h, final_h, am_h = http(ids)
    aux_l, final_l, am_l = local(ids)
    assert aux_h.shape == aux_l.shape == (len(ids), 3 * http.hidden)
    cos = torch.nn.functional.cosine_similarity(aux_h.float(), aux_l.float(), dim=-1)
    assert float(cos.min()) > 0.9999, cos
    # aux rows come with no final-norm output: both pair them with the local runner's
    assert torch.equal(final_h, final_l) and torch.equal(am_h, am_l)


def test_concurrent_requests_return_each_sequence_its_own_rows_in_order(aux_server, model_dir, tok):
    """``server_concurrency``: a batch's prefills in flight together must come back matched to their
    sequences (different lengths, so a mix-up changes a shape) and equal to one request at a time."""
    from kimi_perf.eagle3.features import FeaturePath, FeatureSpec

    seqs = [chat_ids(tok, q)[:n] for q, n in (("Name three primes.", 20), ("Why is the sky blue?", 31),
                                                ("Count to five.", 17), ("What is a drafter?", 26))]
    spec = FeatureSpec(backend="http-aux", dtype="float32", server_url=aux_server.base_url)
    one = FeaturePath(spec, model_dir).batch(seqs)
    many = FeaturePath(FeatureSpec(**{**spec.__dict__, "server_concurrency": 4}), model_dir).batch(seqs)
    assert FeatureSpec(**{**spec.__dict__, "server_concurrency": 4}).digest() == spec.digest()
    for ids, (a1, f1, m1), (a4, f4, m4) in zip(seqs, one, many):
        assert a4.shape == a1.shape == (len(ids), 3 * 576)
        cos = torch.nn.functional.cosine_similarity(a1.float(), a4.float(), dim=-1)
        assert float(cos.min()) > 0.9999, cos
        assert torch.equal(f1, f4) and torch.equal(m1, m4)


def test_http_aux_refuses_a_server_capturing_other_layers(aux_server, model_dir):
    from kimi_perf.eagle3.features import FeaturePath, FeatureSpec

    spec = FeatureSpec(backend="http-aux", dtype="float32", server_url=aux_server.base_url, layer_offset=1)
    with pytest.raises(RuntimeError, match=r"want entering layers \[3, 16, 28\].*--return-aux-hidden-state-layer-ids"):
        FeaturePath(spec, model_dir)
