"""On a CUDA device a layer that would decode on the torch path (eager, several
times slower than stock vLLM) is refused unless ``"allow_slow_path": true``:
in the front end where the setting shows it (a raw 16-bit side inside a packed
slot), and at start-up where only the choice of the layer's decoder does (a kernel that
fails its self-check, :func:`vllm_lowrank.attention.decoders.for_layer`)."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_lowrank.config import LowRankConfig, LowRankConfigError

RAW_SIDE = {"mode": "lowrank", "rank_fraction": 0.5, "k_bits": 16, "v_bits": 4}


@pytest.fixture(scope="module")
def vllm_config(model_path):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model_path, dtype="float32", max_model_len=512).create_engine_config()


def _on(vllm_config, device_type: str):
    """``vllm_config``'s parts that ``check_model`` reads, on ``device_type``."""
    names = ("model_config", "quant_config", "cache_config", "parallel_config")
    return types.SimpleNamespace(**{n: getattr(vllm_config, n) for n in names},
                                 device_config=types.SimpleNamespace(device_type=device_type))


def test_raw_side_in_packed_slot_is_refused_on_cuda_only(vllm_config):
    from vllm_lowrank.models.adapters import check_model

    with pytest.raises(LowRankConfigError, match="allow_slow_path.*true"):
        check_model(_on(vllm_config, "cuda"), LowRankConfig.from_dict(RAW_SIDE))
    check_model(_on(vllm_config, "cuda"),
                LowRankConfig.from_dict({**RAW_SIDE, "allow_slow_path": True}))
    check_model(_on(vllm_config, "cpu"), LowRankConfig.from_dict(RAW_SIDE))
    # both sides quantized: the fused kernels read it
    check_model(_on(vllm_config, "cuda"), LowRankConfig.from_dict({**RAW_SIDE, "k_bits": 8}))


def test_allow_slow_path_must_be_a_bool():
    with pytest.raises(LowRankConfigError, match="allow_slow_path must be true or false"):
        LowRankConfig.from_dict({"mode": "lowrank", "allow_slow_path": "yes"})


@pytest.mark.parametrize("allow", [False, True])
def test_torch_path_on_cuda_is_refused_at_start_up_unless_allowed(monkeypatch, caplog, allow):
    """A layer whose only fused candidate fails at start-up (here: it cannot
    build, or on a GPU its output is off) is refused with the layer's name and a
    warning naming the refusal, unless ``allow_slow_path``: then it decodes on
    the torch path, recorded for ``/metrics`` and kept on the layer."""
    import logging

    from decoder_layer import StandInLayer
    from vllm_lowrank.attention import decoders
    from vllm_lowrank.attention.rope import RopeTable
    from vllm_lowrank.factorization.plan import AttentionShape, LayerPlan

    class Wrong(decoders.GridDecoder):
        """The grid kernel admitted everywhere, its output doubled."""

        name = "triton-wrong"

        @classmethod
        def supports(cls, layer, ctx):
            return None

        def run(self, query, kv_cache, batch, plan, out):
            super().run(query, kv_cache, batch, plan, out)
            out.mul_(2.0)

    monkeypatch.setattr(decoders, "candidates", lambda layer: (Wrong, decoders.TorchDecoder))
    monkeypatch.setattr(decoders, "_LOGGED", set())
    recorded = []
    monkeypatch.setattr("vllm_lowrank.metrics.record_decode_path",
                        lambda name, path: recorded.append((name, path)))
    plan = LayerPlan(AttentionShape(128, 4, 2, 32), 1, (16, 16), (16, 16))
    k_up = torch.zeros(plan.k_width, plan.shape.kv_width)
    k_up[:16, :32], k_up[16:, 32:] = torch.randn(16, 32), torch.randn(16, 32)
    ang = torch.outer(torch.arange(64.0), 1e-2 * torch.arange(1.0, 17.0))
    layer = StandInLayer(plan, k_up=k_up, rope=RopeTable(ang.cos(), ang.sin(), 32, True))
    config = types.SimpleNamespace(
        additional_config={"kv_compression": {"mode": "lowrank", "allow_slow_path": allow}},
        cache_config=types.SimpleNamespace(block_size=16),
        model_config=types.SimpleNamespace(max_model_len=64, dtype=torch.bfloat16))
    cuda = torch.device("cuda")
    with caplog.at_level(logging.WARNING, logger="vllm.lowrank"):
        if not allow:
            with pytest.raises(LowRankConfigError, match=r"layers\.0.*torch path"):
                decoders.for_layer(layer, config, cuda)
            assert not recorded and "decoder" not in layer.__dict__
        else:
            decoder = decoders.for_layer(layer, config, cuda)
            assert decoder.name == "torch"
            assert recorded == [(layer.layer_name, "torch")]
            assert decoders.for_layer(layer, config, cuda) is decoder  # chosen once
            assert len(recorded) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("decoder torch" in w and "triton-wrong: " in w for w in warnings), warnings
