"""The pure parts of ``benchmarks/gpu_soak.py`` (the soak itself needs a GPU):
the request mix, the probe comparison, the KV sizing of the default configs
at the Llama-3-8B shape, and the plan ``--dry-run`` prints."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import benchmark_module

soak = benchmark_module("gpu_soak")

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "num_hidden_layers": 32, "vocab_size": 128256, "max_position_embeddings": 40960,
             "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}


def test_request_mix_is_deterministic_and_covers_the_lengths():
    mix = soak.request_mix(48, seed=1)
    assert mix == soak.request_mix(48, seed=1)
    assert [r.prompt for r in mix] != [r.prompt for r in soak.request_mix(48, seed=2)]
    lengths = sorted(len(r.prompt) for r in mix)
    assert lengths[0] == 64 and lengths[-1] == 32768
    # log-spaced: each length about (32768 / 64) ** (1 / 47) = 1.14x the one before
    assert all(1.05 < b / a < 1.25 for a, b in zip(lengths, lengths[1:]))
    assert all(16 <= r.max_tokens <= 512 for r in mix)
    assert len({r.id for r in mix}) == 48
    aborted = [r.abort_at for r in mix if r.abort_at is not None]
    assert 1 <= len(aborted) < 16 and all(1 <= a <= 120 for a in aborted)


def test_shared_prefixes_are_shared():
    mix = soak.request_mix(48, seed=1) + soak.request_mix(48, seed=2)
    by_prefix = {}
    for r in mix:
        if r.prefix is not None:
            by_prefix.setdefault(r.prefix, []).append(r.prompt)
    assert sum(map(len, by_prefix.values())) >= 8
    for p, prompts in by_prefix.items():
        n = 8192 * (p + 1) // soak.NUM_PREFIXES
        assert all(q[:n] == prompts[0][:n] for q in prompts), p
        assert len({tuple(q[n:]) for q in prompts}) == len(prompts)  # distinct suffixes
    assert any(len(prompts) >= 2 for prompts in by_prefix.values())


def test_request_mix_refuses_an_empty_range():
    with pytest.raises(ValueError, match="need n >= 2"):
        soak.request_mix(1, seed=0)
    with pytest.raises(ValueError):
        soak.request_mix(8, seed=0, min_len=100, max_len=50)


def test_probes_are_fixed():
    probes = soak.probe_prompts()
    assert probes == soak.probe_prompts()
    assert [len(p) for p in probes] == list(soak.PROBE_LENGTHS) and len(probes) == 8


def test_probe_mismatches_stop_at_the_first_near_tie():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    gaps = [[1.0, 1.0, 1.0, 1.0], [1.0, 0.01, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    # probe 0 equal; probe 1 differs after its tie at step 2 (not counted);
    # probe 2 differs at step 3, before any tie
    got = [[1, 2, 3, 4], [5, 6, 0, 0], [9, 9, 0, 9]]
    assert soak.probe_mismatches(got, ref, gaps, tie=0.05) == (1, 4 + 2 + 4)
    assert soak.probe_mismatches(ref, ref, gaps, tie=0.05) == (0, 10)
    assert soak.probe_mismatches(got, ref, gaps, tie=0.001) == (2, 12)


def test_default_configs_fit_the_soak_at_the_llama3_8b_shape(tmp_path):
    """Every default config resolves at the GPU machine's model shape, and its
    KV cache holds the asked tokens and admits the longest request."""
    from vllm_lowrank.config import LowRankConfig
    from vllm_lowrank.estimate import estimate

    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    longest = 32768 + 512 + 16
    for name in soak.DEFAULT_CONFIGS.split(","):
        gib = soak.kv_gib(str(tmp_path), name, 48000, longest)
        spec = soak.gpu_serving.CONFIGS[name]
        info = estimate(str(tmp_path), LowRankConfig.from_dict(
            {"mode": "lowrank", "artifact": "none", **spec["compression"]}), dtype="bfloat16",
            kv_cache_gib=gib, block_size=spec.get("block_size"), context=longest)
        assert info["tokens"] >= 48000 * 0.99 and info["tokens"] >= longest, (name, info)
        assert info["admitted_sequences"] >= 1.49, (name, info)
        assert gib < 8, (name, gib)  # small: 3 x 48k prompt tokens per half overfill it


def test_dry_run_prints_the_plan(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gpu_soak.py", "--dry-run"])
    soak.main()
    out = capsys.readouterr().out
    assert "configs: default,preset-lossless,preset-4x,alloc-8x" in out
    assert "half 1: 24 requests, prompts 64..32768 tokens" in out
    assert "probes: 8 prompts" in out
    monkeypatch.setattr(sys, "argv", ["gpu_soak.py", "--dry-run", "--configs", "nope"])
    with pytest.raises(SystemExit, match="unknown config 'nope'"):
        soak.main()


def test_only_token_adaptive_configs_may_pass_without_a_prefix_hit():
    """The documented limit (README "Limits") excuses the configs that keep exact
    sink and recent tokens, and no other."""
    assert [soak.token_adaptive(n) for n in ("stock", "default", "g1")] == [False] * 3
    assert [soak.token_adaptive(n) for n in
            ("preset-4x", "preset-lossless", "alloc-8x", "tale-k4v4")] == [True] * 4
