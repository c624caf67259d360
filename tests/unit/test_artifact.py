"""Artifact round trip, and refusal of mismatched or damaged artifacts."""

import json
import os

import pytest
import torch

from vllm_lowrank.calibration import artifact as art
from vllm_lowrank.config import LowRankConfigError
from vllm_lowrank.factorization.bases import output_aware_basis

SHAPE = {"hidden_size": 16, "num_heads": 4, "num_kv_heads": 2, "head_dim": 4}


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.{p}.weight": torch.randn(8, 16, generator=g)
            for i in range(2) for p in ("k_proj", "v_proj", "o_proj")}


def _artifact(weights):
    bases = {}
    for i in range(2):
        kb = [output_aware_basis(weights[f"model.layers.{i}.self_attn.k_proj.weight"].T)]
        vb = [output_aware_basis(weights[f"model.layers.{i}.self_attn.v_proj.weight"].T)]
        bases[i] = (kb, vb)
    manifest = art.new_manifest(model_id="tiny", architecture="LlamaForCausalLM", shape=SHAPE,
                                num_layers=2, fingerprint=art.model_fingerprint(weights.items()),
                                method="svd", group_size=2, calibration={"text": "none"})
    return art.Artifact(manifest, bases)


def test_round_trip(tmp_path):
    w = _weights(0)
    a = _artifact(w)
    a.save(str(tmp_path / "a"))
    b = art.load_artifact(str(tmp_path / "a"))
    assert b.manifest == json.loads(json.dumps(a.manifest))
    for i in range(2):
        for side in range(2):
            assert torch.equal(a.bases[i][side][0].a, b.bases[i][side][0].a)
            assert torch.equal(a.bases[i][side][0].energy, b.bases[i][side][0].energy)
    art.check_fingerprint(b.manifest, "a", art.model_fingerprint(w.items()))


def test_fingerprint_ignores_dtype_and_order_but_not_values():
    w = _weights(0)
    f = art.model_fingerprint(w.items())
    bf = {k: v.to(torch.bfloat16) for k, v in w.items()}
    assert art.model_fingerprint(bf.items()) == art.model_fingerprint(
        {k: v.float() for k, v in bf.items()}.items())
    assert art.model_fingerprint(reversed(list(w.items()))) == f
    w2 = dict(w)
    name = next(iter(w2))
    w2[name] = w2[name].clone()
    w2[name][0, 0] += 1e-3
    assert art.model_fingerprint(w2.items()) != f
    # non-attention tensors are not part of the fingerprint
    assert art.model_fingerprint(list(w.items()) + [("model.norm.weight", torch.ones(3))]) == f


def test_mismatched_model_is_refused(tmp_path):
    a = _artifact(_weights(0))
    a.save(str(tmp_path / "a"))
    other = art.model_fingerprint(_weights(1).items())
    with pytest.raises(LowRankConfigError, match="does not match the served weights"):
        art.check_fingerprint(a.manifest, str(tmp_path / "a"), other)
    with pytest.raises(LowRankConfigError, match="another model"):
        art.check_model_matches(a.manifest, "a", architecture="LlamaForCausalLM",
                                num_layers=3, shape=SHAPE)
    with pytest.raises(LowRankConfigError, match="another model"):
        art.check_model_matches(a.manifest, "a", architecture="LlamaForCausalLM",
                                num_layers=2, shape={**SHAPE, "head_dim": 8})


def test_damaged_artifacts_are_refused(tmp_path):
    path = str(tmp_path / "a")
    _artifact(_weights(0)).save(path)
    tensors = os.path.join(path, art.TENSORS)
    data = open(tensors, "rb").read()
    with open(tensors, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(LowRankConfigError, match="truncated or corrupt"):
        art.load_artifact(path)
    os.remove(tensors)
    with pytest.raises(LowRankConfigError, match="no bases.safetensors"):
        art.load_artifact(path)
    with open(os.path.join(path, art.MANIFEST), "w") as f:
        f.write("{not json")
    with pytest.raises(LowRankConfigError, match="corrupt"):
        art.load_artifact(path)
    with pytest.raises(LowRankConfigError, match="does not exist"):
        art.load_artifact(str(tmp_path / "missing"))
