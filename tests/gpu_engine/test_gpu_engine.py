"""The plugin inside vLLM's own engine on a GPU (skipped without CUDA and the
GPU recipe's models). On the GPU machine, from the project root::

    source .gpuvllm/env.sh && python3 -P -m pytest tests/gpu_engine -q

Each configuration runs in its own engine process (``probe.py``): greedy
generation with CUDA graphs (``FULL_DECODE_ONLY``), chunked prefill mixed with
decode, a prefix-cache hit, and preemption with a cache of few blocks. Checks:
no crash, finite log-probabilities, the requested lengths; at ratio 1.0 in
float32 the greedy tokens equal stock vLLM's (up to near ties); the KV capacity
vLLM reports at a fixed cache size equals the compression ratio within 3 %;
a preempted run gives the tokens of an unpreempted one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from vllm_lowrank.presets import expand

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif("GPUVLLM_MODELS" not in os.environ,
                       reason="needs the GPU recipe (source .gpuvllm/env.sh)"),
]

PROBE = os.path.join(os.path.dirname(__file__), "probe.py")
TIE32 = 1e-6  # float32: a top-2 gap below this may flip between engines
TIE16 = 2e-2  # bf16

SETTINGS = {
    # what `--kv-compression lowrank` alone serves (presets.DEFAULT_PRESET:
    # full-rank post-RoPE latents, K8/V4 per token)
    "default": {"preset": "2x"},
    # a config without a preset: the field defaults (J-LRD, ratio 0.5, 16-bit)
    "jlrd": {},
    "g1-uniform": {"rank_fraction": 0.5, "head_group_size": 1, "rank_allocation": "uniform"},
    "g1-energy": {"rank_fraction": 0.5, "head_group_size": 1, "rank_allocation": "energy"},
    "g2": {"rank_fraction": 0.5, "head_group_size": 2, "rank_allocation": "uniform"},
    "k4v4": {"rank_fraction": 0.5, "head_group_size": 1, "rank_allocation": "uniform", "k_bits": 4,
             "v_bits": 4},
    "k8v8-full": {"rank_fraction": 1.0, "k_bits": 8, "v_bits": 8},
    "token-adaptive": {"rank_fraction": 0.5, "head_group_size": 1, "token_adaptive": True,
                       "sink_tokens": 16, "recent_tokens": 64},
    "token-adaptive-k4c": {"rank_fraction": 0.5, "head_group_size": 1, "token_adaptive": True,
                           "sink_tokens": 16, "recent_tokens": 64, "k_bits": 4, "v_bits": 4,
                           "k_quant": "channel", "k_channel_tokens": 16},
    # the presets above 3x: post-RoPE key codes beside value latents, no key rebuild
    "preset-4x": {"preset": "4x"},
    "preset-lossless": {"preset": "lossless"},
    # J-LRD latents at 0.75, per-channel keys on the wide-group kernel (the keys
    # rebuilt), value rank 768 in the varlen prefill, int8 exact tokens (key groups
    # of 16 tokens: vLLM's default block)
    "jlrd-0.75-tale": {"rank_fraction": 0.75, "k_bits": 4, "v_bits": 4, "token_adaptive": True,
                       "sink_tokens": 32, "recent_tokens": 128, "k_quant": "channel",
                       "k_channel_tokens": 16, "exact_bits": 8},
    # the 8x recipe's storage with key bases that commute with RoPE (weight-only
    # rope_equivariant bases: artifact "none"): the latent span decodes with the
    # queries absorbed (decode_latent_rope)
    "rope-equivariant-tale": {"rank_fraction": 0.25, "method": "rope_equivariant",
                              "token_adaptive": True, "sink_tokens": 32, "recent_tokens": 64,
                              "k_bits": 4, "v_bits": 4, "k_quant": "channel",
                              "k_channel_tokens": 16, "exact_bits": 8},
    # post-RoPE keys (4-bit per channel) beside per-head value latents at half rank:
    # latent span and exact tokens in one kernel (decode_post_rope)
    "post-rope-keys": {"post_rope_keys": True, "rank_fraction": 0.75, "head_group_size": 1,
                       "rank_allocation": "uniform", "token_adaptive": True,
                       "sink_tokens": 16, "recent_tokens": 64, "k_bits": 4, "v_bits": 4,
                       "k_quant": "channel", "k_channel_tokens": 16, "exact_bits": 8},
}

_CACHE: dict = {}


def probe(model: str, config: dict | None, *, dtype: str = "bfloat16", blocks=None,
          eager: bool = False, speculative: bool = False, tp: int = 1,
          block_size: int | None = None, weights: str = "dummy") -> dict:
    """``probe.py``'s result for one engine (run once per argument set)."""
    key = (model, json.dumps(config, sort_keys=True), dtype, blocks, eager, speculative, tp,
           block_size, weights)
    if key not in _CACHE:
        cmd = [sys.executable, "-P", PROBE, "--model", model, "--config", json.dumps(config),
               "--dtype", dtype, "--tensor-parallel-size", str(tp), "--weights", weights]
        if blocks:
            cmd += ["--blocks", str(blocks)]
        if block_size:
            cmd += ["--block-size", str(block_size)]
        if eager:
            cmd.append("--eager")
        if speculative:
            cmd.append("--speculative")
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        lines = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
        assert lines, f"probe died:\n{res.stderr[-3000:]}"
        _CACHE[key] = json.loads(lines[-1][7:])
        report = os.environ.get("GPU_ENGINE_REPORT")
        if report:  # which path and graph mode each engine ran (for the notes)
            with open(report, "a") as f:
                f.write(json.dumps(dict(model=model, config=config, dtype=dtype, blocks=blocks,
                                        tp=tp, weights=weights,
                                        **{k: _CACHE[key].get(k) for k in (
                                            "paths", "cudagraph_mode", "kv_tokens",
                                            "compression_ratio", "preemptions",
                                            "prefix_hits", "accepted", "drafted",
                                            "error")})) + "\n")
    out = _CACHE[key]
    assert "error" not in out, out["error"]
    return out


def _same_until_tie(got, ref, tie) -> int:
    """Tokens equal up to the reference's first near tie; returns how many."""
    n = 0
    for g, r, gap in zip(got["tokens"], ref["tokens"], ref["gaps"]):
        if gap < tie:
            break
        assert g == r, (got["tokens"], ref["tokens"])
        n += 1
    return n


def _float32_steps_agree(got_run: dict, ref_run: dict, tol: float) -> int:
    """Float32 runs of the same prompts: greedy tokens equal up to the first
    near tie (``TIE32``), the chosen tokens' log-probabilities within ``tol``
    nats at those steps and the next; returns how many steps were compared."""
    compared = 0
    for scenario in ("short", "mixed", "hit", "repeat"):
        for got, ref in zip(got_run[scenario], ref_run[scenario]):
            n = _same_until_tie(got, ref, TIE32)
            for a, b in zip(got["top"][:n + 1], ref["top"][:n + 1]):
                assert abs(a - b) < tol, (scenario, a, b)
                compared += 1
    return compared


def _check_run(out: dict, expect_hit: bool = True) -> None:
    for scenario, lengths in (("short", [16]), ("mixed", [24]), ("hit", [24])):
        for r in out[scenario]:
            assert len(r["tokens"]) in lengths and r["finite"], scenario
    if expect_hit:
        assert out["prefix_hits"] > 0
    assert out["hit"][0]["tokens"] == out["mixed"][1]["tokens"] or \
        _same_until_tie(out["hit"][0], out["mixed"][1], TIE16) >= 1


@pytest.mark.parametrize("model", ["small-h128", "smollm2-shape"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_setting_runs_with_graphs_chunked_prefill_and_prefix_hits(model, setting):
    """Every setting serves through CUDA graphs (where its decode path allows),
    chunked prefill mixed with decode, and a prefix-cache hit; vLLM's KV
    capacity at a fixed cache size is the compression ratio (token-adaptive
    settings hold exact tokens besides: their capacity is the load test's)."""
    if model == "smollm2-shape" and setting == "g2":
        pytest.skip("head groups of 2 do not divide SmolLM2's 3 KV heads (refused at start-up)")
    out = probe(model, SETTINGS[setting])
    _check_run(out)
    if expand(SETTINGS[setting]).get("token_adaptive"):
        return
    stock = probe(model, None)
    ratio = out["kv_tokens"] / stock["kv_tokens"]
    assert ratio == pytest.approx(out["compression_ratio"], rel=0.03), \
        (out["kv_tokens"], stock["kv_tokens"], out["compression_ratio"])


@pytest.mark.parametrize("model", ["small-h128", "smollm2-shape"])
def test_full_rank_float32_greedy_equals_stock(model):
    """At ratio 1.0 in float32 the engine computes stock attention up to
    float32 rounding: the chosen tokens' log-probabilities agree within 1e-5
    nats wherever the tokens agree, and the tokens agree up to the first top-2
    gap under 1e-6 nats (dummy weights give nearly flat logits, so real-weight
    greedy equality is the CPU engine tests')."""
    stock = probe(model, None, dtype="float32")
    full = probe(model, {"rank_fraction": 1.0, "head_group_size": 1}, dtype="float32")
    assert _float32_steps_agree(full, stock, 1e-5) >= 15  # every prompt's first step


@pytest.mark.parametrize("setting", ["default", "g1-uniform"])
def test_preemption_recomputes_the_same_tokens(setting):
    base = probe("small-h128", SETTINGS[setting])
    # 10 prompts of 40..1,500 tokens + 24 generated need ~400 blocks of 16
    tight = probe("small-h128", SETTINGS[setting], blocks=260)
    assert tight["preemptions"] > 0
    _check_run(tight, expect_hit=False)
    for got, ref in zip(tight["mixed"], base["mixed"]):
        _same_until_tie(got, ref, TIE16)


@pytest.mark.parametrize("setting", ["token-adaptive", "token-adaptive-k4c"])
def test_token_adaptive_decode_is_captured_and_equals_eager(setting):
    """Token-adaptive layers decode inside CUDA graphs (the exact part is a
    fixed-shape torch computation, per-channel key groups are written without
    a host sync) and give the eager engine's tokens and log-probabilities, in
    float32 (dummy weights give near-flat logits: bf16 ties at the first token)."""
    graphs = probe("small-h128", SETTINGS[setting], dtype="float32")
    eager = probe("small-h128", SETTINGS[setting], dtype="float32", eager=True)
    assert graphs["cudagraph_mode"] != "NONE" and "FULL" in graphs["cudagraph_mode"], \
        graphs["cudagraph_mode"]
    assert _float32_steps_agree(graphs, eager, 1e-4) >= 15


@pytest.mark.parametrize("model", ["small-h128", "smollm2-shape"])
def test_rope_equivariant_layers_decode_with_absorbed_queries(model):
    """A ``rope_equivariant`` token-adaptive setting takes the RoPE-equivariant
    latent kernel in every layer (after its start-up self-check against the torch
    path, which rebuilds the keys), inside CUDA graphs, and its float32 tokens
    and log-probabilities equal the eager engine's."""
    from vllm_lowrank.attention.decoders import LatentRopeDecoder

    setting = SETTINGS["rope-equivariant-tale"]
    graphs = probe(model, setting, dtype="float32")
    name = f"token-adaptive+{LatentRopeDecoder.name}"  # its latent span on that kernel
    assert graphs["paths"] and all(p.split(":")[0] == name for p in graphs["paths"]), \
        graphs["paths"]
    assert "FULL" in graphs["cudagraph_mode"], graphs["cudagraph_mode"]
    eager = probe(model, setting, dtype="float32", eager=True)
    assert _float32_steps_agree(graphs, eager, 1e-4) >= 15


@pytest.mark.parametrize("model", ["small-h128", "smollm2-shape"])
def test_post_rope_keys_decode_in_one_kernel_inside_graphs(model):
    """A ``post_rope_keys`` setting takes the fused post-RoPE-keys decoder in
    every layer (after its start-up self-check against the torch path), inside
    CUDA graphs, and its float32 tokens and log-probabilities equal the eager
    engine's."""
    from vllm_lowrank.attention.decoders import PostRopeKeysDecoder

    setting = SETTINGS["post-rope-keys"]
    graphs = probe(model, setting, dtype="float32")
    assert graphs["paths"] and all(p.split(":")[0] == PostRopeKeysDecoder.name
                                   for p in graphs["paths"]), graphs["paths"]
    assert "FULL" in graphs["cudagraph_mode"], graphs["cudagraph_mode"]
    eager = probe(model, setting, dtype="float32", eager=True)
    assert _float32_steps_agree(graphs, eager, 1e-4) >= 15


SPECULATED = ["default", "jlrd", "token-adaptive-k4c", "preset-4x", "preset-lossless",
              "jlrd-0.75-tale", "rope-equivariant-tale", "post-rope-keys"]


@pytest.mark.parametrize("setting", SPECULATED)
def test_speculative_decoding_keeps_the_tokens(setting):
    """With n-gram speculative decoding (3 drafts), verify steps decode several
    query tokens per request (one decode row each, causal over the drafts),
    inside CUDA graphs where the decoder allows (``UNIFORM_BATCH``); in float32
    the tokens and log-probabilities equal the same engine without
    speculation. The repeated prompts make the proposer draft; the tokens the
    dummy weights accept are reported, not required (the CPU engine tests,
    with real weights, require acceptance)."""
    plain = probe("small-h128", SETTINGS[setting], dtype="float32")
    spec = probe("small-h128", SETTINGS[setting], dtype="float32", speculative=True)
    assert spec["drafted"] > 0
    assert "FULL" in spec["cudagraph_mode"], spec["cudagraph_mode"]
    # 2e-4 nats: a verify step computes 4 query tokens per request where the plain
    # engine computes 1, so every matmul of the model reduces in another order; at
    # a log-probability of -10.38 (128k vocabulary) vLLM 0.33 on an H200 gave
    # 1.06e-4 (the J-LRD 0.75 recipe) and 1.02e-4 (preset-4x), 1e-5 of the value
    assert _float32_steps_agree(spec, plain, 2e-4) >= 19


def test_full_rank_speculation_equals_stock_speculation():
    stock = probe("small-h128", None, dtype="float32", speculative=True)
    full = probe("small-h128", {"rank_fraction": 1.0, "head_group_size": 1}, dtype="float32",
                 speculative=True)
    assert _float32_steps_agree(full, stock, 1e-5) >= 19
