"""`vllm serve ... --kv-compression lowrank` end to end (OpenAI server on
127.0.0.1), and the CLI's refusals of bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from server_harness import VLLM, Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("servers"))


@pytest.fixture(scope="module")
def stock_server(model_path, log_dir):
    s = Server(model_path, log_dir=log_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def full_rank_server(model_path, log_dir):
    # --additional-config after the flags must not overwrite them.
    s = Server(model_path, "--kv-compression", "lowrank",
               "--kv-compression-config", '{"rank_fraction": 1.0}',
               "--additional-config", json.dumps({"other_plugin": 1,
                                                  "kv_compression": {"rank_fraction": 0.25}}),
               log_dir=log_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def default_server(model_path, log_dir):
    s = Server(model_path, "--kv-compression", "lowrank", log_dir=log_dir)
    yield s
    s.stop()


def _capacity(server) -> int:
    import re

    m = re.search(r"KV cache size: ([\d,]+) tokens", server.text())
    return int(m.group(1).replace(",", ""))


def test_full_rank_server_matches_uncompressed(stock_server, full_rank_server):
    assert full_rank_server.greedy() == stock_server.greedy()
    assert "'rank_fraction': 1.0" in full_rank_server.text()
    assert _capacity(full_rank_server) == _capacity(stock_server)


def test_default_server_answers_chat_and_completion(default_server, stock_server, model_path):
    client = default_server.client()
    chat = client.chat.completions.create(
        model="m", temperature=0, max_tokens=24,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in chat.choices[0].message.content
    comp = client.completions.create(model="m", prompt="The capital of France is",
                                     temperature=0, max_tokens=8)
    assert "Paris" in comp.choices[0].text
    # the default preset: 8-bit keys, 4-bit values per KV head and token, one
    # float16 scale and zero per head and side, against float32 K and V
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_path)
    width = hf.num_key_value_heads * (hf.hidden_size // hf.num_attention_heads)
    slot = width * 8 // 8 + width * 4 // 8 + hf.num_key_value_heads * 2 * 2 * 2
    ratio = _capacity(default_server) / _capacity(stock_server)
    assert ratio == pytest.approx(2 * width * 4 / slot, rel=0.03)


def test_estimate_predicts_the_served_capacity(default_server, stock_server, model_path):
    """`vllm-lowrank estimate` (no engine) gives the KV tokens the servers
    logged, within 3 %, for the default and for an uncompressed cache."""
    import os

    from vllm_lowrank.config import LowRankConfig
    from vllm_lowrank.estimate import estimate

    info = estimate(model_path, LowRankConfig.from_dict({"mode": "lowrank"}), dtype="float32",
                    kv_cache_gib=float(os.environ["VLLM_CPU_KVCACHE_SPACE"]))
    assert info["tokens"] == pytest.approx(_capacity(default_server), rel=0.03)
    assert info["stock_tokens"] == pytest.approx(_capacity(stock_server), rel=0.03)


def _serve_fails(*args, timeout=300):
    proc = subprocess.run([VLLM, "serve", *args], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.splitlines() if "vllm-lowrank: error:" in l]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_unknown_mode_is_one_line_error(model_path):
    line = _serve_fails(model_path, "--kv-compression", "zip")
    assert "'zip'" in line and "none, lowrank" in line


def test_rank_fraction_out_of_range_is_one_line_error(model_path):
    line = _serve_fails(model_path, "--kv-compression", "lowrank",
                        "--kv-compression-config", '{"rank_fraction": 1.5}')
    assert "rank_fraction=1.5" in line and "0 < rank_fraction <= 1" in line


def test_malformed_json_is_one_line_error(model_path):
    line = _serve_fails(model_path, "--kv-compression", "lowrank",
                        "--kv-compression-config", '{"rank_fraction": 0.5')
    assert "malformed JSON" in line


def test_config_without_lowrank_is_one_line_error(model_path):
    line = _serve_fails(model_path, "--kv-compression-config", '{"rank_fraction": 0.5}')
    assert "--kv-compression lowrank" in line


def test_unsupported_architecture_lists_supported(model_path, tmp_path):
    from transformers import GPT2Config

    folder = tmp_path / "gpt2"
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=49152).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(model_path, name), folder)
    line = _serve_fails(str(folder), "--kv-compression", "lowrank")
    assert "does not support architecture GPT2" in line
    assert "supported: Gemma3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, " \
        "Qwen2ForCausalLM, Qwen3ForCausalLM" in line


def test_help_shows_the_options():
    out = subprocess.run([VLLM, "serve", "--help=KVCompression"], capture_output=True,
                         text=True, timeout=300).stdout
    assert "--kv-compression {none,lowrank}" in out
    assert "--kv-compression-config" in out and "rank_fraction" in out and "head_group_size" in out
