"""On a CUDA device a layer that would decode on the torch path (eager, several
times slower than stock vLLM) is refused unless ``"allow_slow_path": true``:
in the front end where the setting shows it (a raw 16-bit side inside a packed
slot), and at start-up where only the decode-path choice does (a kernel that
fails its self-check)."""

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
def test_torch_path_on_cuda_is_refused_at_start_up_unless_allowed(monkeypatch, allow):
    from vllm_lowrank.attention import decode_path as dp

    why = "triton: disagrees with the torch path (error 0.9 > 0.05)"
    monkeypatch.setattr(dp, "choose_decode_path", lambda *a, **k: dp.DecodePath("torch", why))
    recorded = []
    monkeypatch.setattr("vllm_lowrank.metrics.record_decode_path",
                        lambda name, path: recorded.append((name, path)))
    layer = types.SimpleNamespace(layer_name="model.layers.0.self_attn.attn",
                                  sliding_window=None)
    config = types.SimpleNamespace(
        additional_config={"kv_compression": {"mode": "lowrank", "allow_slow_path": allow}},
        cache_config=types.SimpleNamespace(block_size=16),
        model_config=types.SimpleNamespace(max_model_len=512))
    if not allow:
        with pytest.raises(LowRankConfigError, match=r"layers\.0.*torch path.*disagrees"):
            dp.decode_path(layer, torch.bfloat16, torch.device("cuda"), config)
        assert not recorded
        return
    assert dp.decode_path(layer, torch.bfloat16, torch.device("cuda"), config).name == "torch"
    assert recorded == [(layer.layer_name, "torch")]
