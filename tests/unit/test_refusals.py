"""Models and settings the latent cache cannot serve are refused when vLLM
builds its config (before any engine process starts), with a message that
names the problem and lists what is supported (issue 7). The same check runs
under ``vllm serve`` as a one-line error (``test_server.py``)."""

from __future__ import annotations

import os
import shutil

import pytest

from vllm_lowrank.config import LowRankConfigError
from vllm_lowrank.models.architectures import ARCHITECTURES

SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def _folder(tmp_path, model_path, config, **extra) -> str:
    """A config-only model folder (no weights are needed to build vLLM's config)."""
    folder = tmp_path / type(config).__name__
    for key, value in extra.items():
        setattr(config, key, value)
    config.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(model_path, name), folder)
    return str(folder)


def _refusal(model: str, compression: dict | None = None) -> str:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=model, dtype="float32", max_model_len=512,
                      additional_config={"kv_compression": compression or {"mode": "lowrank"}})
    with pytest.raises(LowRankConfigError) as info:
        args.create_engine_config()
    return str(info.value)


def _lists_supported(message: str) -> bool:
    return all(arch in message for arch in ARCHITECTURES)


def test_unsupported_architecture(tmp_path, model_path):
    from transformers import GPT2Config

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=49152, bos_token_id=0,
                        eos_token_id=0)
    config.architectures = ["GPT2LMHeadModel"]
    message = _refusal(_folder(tmp_path, model_path, config))
    assert "does not support architecture GPT2LMHeadModel" in message
    assert _lists_supported(message)


def test_gemma3_soft_capping(tmp_path, model_path):
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(head_dim=16, query_pre_attn_scalar=16, sliding_window=64,
                              attn_logit_softcapping=50.0, **SMALL)
    config.architectures = ["Gemma3ForCausalLM"]
    message = _refusal(_folder(tmp_path, model_path, config))
    assert "Gemma3ForCausalLM" in message and "soft-capping" in message


def test_bidirectional_qwen3(tmp_path, model_path):
    from transformers import Qwen3Config

    config = Qwen3Config(head_dim=16, **SMALL)
    config.architectures = ["Qwen3ForCausalLM"]
    message = _refusal(_folder(tmp_path, model_path, config, is_causal=False))
    assert "bidirectional" in message


def test_mistral_position_dependent_query_scaling(tmp_path, model_path):
    from transformers import MistralConfig

    config = MistralConfig(head_dim=16, **SMALL)
    config.architectures = ["MistralForCausalLM"]
    folder = _folder(tmp_path, model_path, config, llama_4_scaling={
        "original_max_position_embeddings": 256, "beta": 0.1})
    assert "query scaling" in _refusal(folder)


def test_ratio_giving_rank_zero(model_path):
    message = _refusal(model_path, {"mode": "lowrank", "rank_fraction": 0.01,
                                    "rank_allocation": "uniform"})
    assert "rank 0" in message and "raise rank_fraction" in message


def test_mla_model(tmp_path, model_path):
    from transformers import DeepseekV2Config

    config = DeepseekV2Config(kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                              qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                              first_k_dense_replace=2, **SMALL)
    config.architectures = ["DeepseekV2ForCausalLM"]
    message = _refusal(_folder(tmp_path, model_path, config))
    assert "MLA" in message and "already a latent" in message and _lists_supported(message)
