"""Tensor parallelism (``tensor_parallel_size=2``, vLLM's CPU ``mp`` executor).

A small random-weight Llama (4 layers, 8 query and 4 KV heads of 32, float32;
the embedded SmolLM2 tokenizer) is served at TP=1 and TP=2, and TP=2 is
compared with independent references:

- ratio 1.0: the same greedy tokens as the uncompressed TP=1 engine and the
  compressed TP=1 engine;
- ratio 0.5 with an artifact calibrated on the random model (2 KV heads per
  group: one group per rank at TP=2, two groups at TP=1): the same greedy
  tokens as TP=1, so each rank built exactly its slice of the TP=1 factors;
- capacity: each rank's KV cache holds exactly its latent bytes per token
  (read from what every worker reports), and every rank reports the same;
- loss-aware (``fisher``) rank allocation at TP=2: one plan for all ranks;
- refused at start-up, one line: an artifact whose head groups would span
  ranks, and a ``group_size`` that does not divide a rank's KV heads.

Greedy comparisons stop at the first step where the reference itself is at a
near-tie (top-2 log-probability gap under 1e-3 nats): TP=2 sums the row-
parallel ``o_proj`` in another order, which may flip an exact tie.
"""

from __future__ import annotations

import gc
import os

import pytest

from conftest import (TIE, benchmark_module, clear_worker_states, greedy_with_gaps, make_llm,
                      worker_states)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
]
MAX_TOKENS = 24
KV_SPACE = 1 << 30  # VLLM_CPU_KVCACHE_SPACE=1 (conftest): bytes per rank
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 4, 8, 4, 32


@pytest.fixture(scope="module")
def tiny_model(model_path, tmp_path_factory) -> str:
    """Random-weight ``LlamaForCausalLM`` with the embedded model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = str(tmp_path_factory.mktemp("tiny-llama"))
    tok = AutoTokenizer.from_pretrained(model_path)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=256, intermediate_size=512,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, max_position_embeddings=2048, initializer_range=0.1,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_artifact(tiny_model, tmp_path_factory) -> str:
    """Fisher bases of the random model, groups of 2 KV heads (serves TP 1 and 2)."""
    from vllm_lowrank.calibration.calibrate import calibrate_model

    path = str(tmp_path_factory.mktemp("artifacts") / "g2")
    calibrate_model(tiny_model, method="fisher", group_size=2, num_tokens=1024).save(path)
    return path


def _run(model: str, compression: dict | None, tp: int) -> dict:
    """Greedy tokens and top-2 gaps for :data:`PROMPTS`, the KV capacity in
    tokens (per rank: every rank allocates the same number of blocks), what
    every worker reports (``ModelCompression.summary``), and the decoders
    ``benchmarks/gpu_serving.py`` reads from the workers (``paths``)."""
    kwargs = {}
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if tp > 1:
        # vLLM's automatic binding wants one NUMA node per rank; bind one CPU each.
        cpus = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            str(cpus[i % len(cpus)]) for i in range(tp))
        kwargs = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}
    clear_worker_states()
    try:
        llm = make_llm(model, compression, max_model_len=512, **kwargs)
    finally:
        if saved is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved
    try:
        cc = llm.llm_engine.vllm_config.cache_config
        tokens, gaps = greedy_with_gaps(llm, PROMPTS, MAX_TOKENS)
        result = {"capacity": cc.num_gpu_blocks * cc.block_size, "block_size": cc.block_size,
                  "tokens": tokens, "gaps": gaps, "states": worker_states(),
                  "paths": benchmark_module("gpu_serving")._paths(llm)}
    finally:
        del llm
        gc.collect()
    return result


def _assert_same_greedy(got: dict, ref: dict, at_least: int = 16) -> None:
    """Tokens equal up to the reference's first near-tie, which must come no
    earlier than ``at_least`` tokens in."""
    for g, r, gaps in zip(got["tokens"], ref["tokens"], ref["gaps"]):
        n = next((i for i, gap in enumerate(gaps) if gap < TIE), len(r))
        assert n >= at_least, f"reference near-tie at step {n}: {gaps[:n + 1]}"
        assert g[:n] == r[:n]


def _expected_capacity(bytes_per_token: int, block_size: int) -> int:
    return KV_SPACE // (bytes_per_token * block_size) * block_size


# ------------------------------------------------------------------ engines

@pytest.fixture(scope="module")
def stock_tp1(tiny_model):
    return _run(tiny_model, None, 1)


@pytest.fixture(scope="module")
def full_tp1(tiny_model):
    return _run(tiny_model, {"mode": "lowrank", "rank_fraction": 1.0}, 1)


@pytest.fixture(scope="module")
def full_tp2(tiny_model):
    return _run(tiny_model, {"mode": "lowrank", "rank_fraction": 1.0}, 2)


def _half(artifact: str) -> dict:
    return {"mode": "lowrank", "rank_fraction": 0.5, "artifact": artifact,
            "rank_allocation": "uniform"}


@pytest.fixture(scope="module")
def half_tp1(tiny_model, tiny_artifact):
    return _run(tiny_model, _half(tiny_artifact), 1)


@pytest.fixture(scope="module")
def half_tp2(tiny_model, tiny_artifact):
    return _run(tiny_model, _half(tiny_artifact), 2)


@pytest.mark.slow
def test_full_rank_tp2_equals_tp1_and_uncompressed(stock_tp1, full_tp1, full_tp2):
    _assert_same_greedy(full_tp1, stock_tp1)
    _assert_same_greedy(full_tp2, stock_tp1)
    _assert_same_greedy(full_tp2, full_tp1)


@pytest.mark.slow
def test_full_rank_capacity_per_rank(stock_tp1, full_tp1, full_tp2):
    fp32 = 4
    full = LAYERS * 2 * KV_HEADS * HEAD_DIM * fp32  # K+V bytes per token, all heads
    assert stock_tp1["capacity"] == _expected_capacity(full, stock_tp1["block_size"])
    assert full_tp1["capacity"] == stock_tp1["capacity"]
    # each rank caches half of the heads in its own 1 GiB: twice the tokens
    assert [s["stored_bytes_per_token"] for s in full_tp2["states"]] == [full // 2] * 2
    assert full_tp2["capacity"] == _expected_capacity(full // 2, full_tp2["block_size"])


@pytest.mark.slow
def test_gpu_serving_reads_the_decoders_from_the_workers(stock_tp1, full_tp2):
    """``gpu_serving._paths`` asks every worker (``collective_rpc``): with the
    ``mp`` executor the layers live in the worker processes (on a CPU each
    latent layer decodes on the torch path)."""
    assert full_tp2["paths"]["path"] == "torch", full_tp2["paths"]
    assert stock_tp1["paths"]["path"] == "stock", stock_tp1["paths"]


@pytest.mark.slow
def test_half_ratio_tp2_equals_tp1(half_tp1, half_tp2):
    _assert_same_greedy(half_tp2, half_tp1)
    tp1_ranks = half_tp1["states"][0]["layers"]
    for rank, state in enumerate(half_tp2["states"]):  # one group of 2 KV heads per rank
        assert state["parallel"]["tp"] == rank
        assert state["layers"] == {i: {"k_ranks": [r["k_ranks"][rank]],
                                       "v_ranks": [r["v_ranks"][rank]],
                                       "kv_width": r["kv_width"] // 2,
                                       "bits": r["bits"]}
                                   for i, r in tp1_ranks.items()}


@pytest.mark.slow
def test_half_ratio_capacity_per_rank(half_tp1, half_tp2, stock_tp1):
    fp32 = 4
    latent = LAYERS * 2 * KV_HEADS * HEAD_DIM * fp32 // 2  # ratio 0.5, all heads
    assert [s["stored_bytes_per_token"] for s in half_tp1["states"]] == [latent]
    assert [s["stored_bytes_per_token"] for s in half_tp2["states"]] == [latent // 2] * 2
    assert half_tp1["capacity"] == _expected_capacity(latent, half_tp1["block_size"])
    assert half_tp2["capacity"] == _expected_capacity(latent // 2, half_tp2["block_size"])
    assert half_tp2["capacity"] == 4 * stock_tp1["capacity"]


def test_loss_aware_ranks_are_tied_across_ranks(tiny_model, tiny_artifact):
    """``rank_allocation: fisher`` at TP=2: one plan serves both ranks (group
    ``j`` of every rank tied), spending the per-rank budget, not uniformly."""
    from transformers import AutoConfig

    from vllm_lowrank.calibration.artifact import load_artifact
    from vllm_lowrank.config import LowRankConfig
    from vllm_lowrank.models import compression as comp

    hf = AutoConfig.from_pretrained(tiny_model)
    cfg = LowRankConfig(mode="lowrank", rank_fraction=0.5, artifact=tiny_artifact)
    plans = comp.allocate(cfg, comp.model_shapes(hf, 2), load_artifact(tiny_artifact))
    assert all(p.num_groups == 1 and p.shape.num_kv_heads == 2 for p in plans.values())
    widths = [p.k_width + p.v_width for p in plans.values()]
    budget = 0.5 * LAYERS * 2 * (KV_HEADS // 2) * HEAD_DIM  # per rank
    assert budget - 8 < sum(widths) <= budget
    assert len({(p.k_ranks, p.v_ranks) for p in plans.values()}) > 1  # allocated


# ------------------------------------------------------------------ start-up refusals

def _engine_config(model: str, compression: dict, tp: int):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, dtype="float32", enforce_eager=True, max_model_len=512,
                      tensor_parallel_size=tp, distributed_executor_backend="mp",
                      additional_config={"kv_compression": compression}
                      ).create_engine_config()


def test_artifact_groups_spanning_ranks_are_refused(tiny_model, tmp_path):
    """A joint (all 4 KV heads) artifact, made for TP=1, at TP=2: one line
    naming both sizes and the fix; the same artifact is accepted at TP=1."""
    from vllm_lowrank.calibration.calibrate import calibrate_model
    from vllm_lowrank.config import LowRankConfigError

    path = str(tmp_path / "joint")
    calibrate_model(tiny_model, method="svd", num_tokens=1024).save(path)
    cfg = {"mode": "lowrank", "rank_fraction": 0.5, "artifact": path, "method": "svd",
           "rank_allocation": "uniform"}
    _engine_config(tiny_model, cfg, 1)
    with pytest.raises(LowRankConfigError) as e:
        _engine_config(tiny_model, cfg, 2)
    message = str(e.value)
    assert "\n" not in message
    assert path in message
    assert "tensor-parallel size 1" in message and "--tensor-parallel-size 2" in message
    assert "--head-group-size 2" in message


def test_group_size_spanning_ranks_is_refused(tiny_model):
    from vllm_lowrank.config import LowRankConfigError

    with pytest.raises(LowRankConfigError, match=r"head_group_size=4 does not divide the 2 KV "
                       r"heads of each rank at --tensor-parallel-size 2") as e:
        _engine_config(tiny_model, {"mode": "lowrank", "rank_fraction": 0.5, "head_group_size": 4,
                                    "artifact": "none"}, 2)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ units

def test_tied_spectra_is_identity_at_tp1_and_sums_per_position():
    import torch

    from vllm_lowrank.factorization.shard import tied_spectra

    e = [torch.tensor([4.0, 2.0]), torch.tensor([1.0, 1.0]),
         torch.tensor([3.0, 1.0]), torch.tensor([2.0, 0.0])]
    same, norm = tied_spectra({0: (e, e)}, 4, True)
    assert norm and all(torch.equal(a, b) for a, b in zip(same[0][0], e))
    tied, norm = tied_spectra({0: (e, e)}, 2, False)  # 2 ranks of 2 groups
    assert not norm
    assert torch.allclose(tied[0][0][0], torch.tensor([7.0, 3.0]))  # groups 0 and 2
    assert torch.allclose(tied[0][0][1], torch.tensor([3.0, 1.0]))  # groups 1 and 3
    tied, norm = tied_spectra({0: (e, e)}, 2, True)
    assert not norm  # already normalised per basis before summing
    assert torch.allclose(tied[0][0][0], torch.tensor([4 / 6 + 3 / 4, 2 / 6 + 1 / 4]))


def test_serving_sizes_and_rank_overrides():
    from vllm_lowrank.config import LowRankConfig, LowRankConfigError
    from vllm_lowrank.factorization.shard import rank_config, serving_sizes

    assert serving_sizes(8, 4, 4) == [1]
    assert serving_sizes(8, 4, 2) == [1, 2]
    assert serving_sizes(8, 4, 1) == [1, 2, 4]
    cfg = LowRankConfig(mode="lowrank", ranks={0: (64, 32)})
    assert rank_config(cfg, 2, 2).ranks == {0: (32, 16)}
    assert rank_config(cfg, 1, 4) is cfg
    with pytest.raises(LowRankConfigError, match="split evenly"):
        rank_config(LowRankConfig(mode="lowrank", ranks={0: (63, 32)}), 2, 2)


def test_rank_factors_are_slices_of_the_tp1_factors():
    """Each rank's slice of the weights and bases (groups of 2 KV heads, 2
    ranks) yields exactly its columns of the TP=1 fused projection, its block
    of ``B_k``, its columns of the folded ``o_proj``; a value bias is folded
    once, for the whole model, into ``o_proj.bias``."""
    import torch

    from vllm_lowrank.factorization import fold
    from vllm_lowrank.factorization.bases import output_aware_basis
    from vllm_lowrank.factorization.plan import AttentionShape, LayerPlan
    from vllm_lowrank.factorization.shard import local_bases, local_weights

    g = torch.Generator().manual_seed(0)
    hidden, d = 32, 8
    full = AttentionShape(hidden, 8, 4, d)
    w = {"q_proj": torch.randn(64, hidden, generator=g),
         "k_proj": torch.randn(32, hidden, generator=g),
         "v_proj": torch.randn(32, hidden, generator=g),
         "o_proj": torch.randn(hidden, 64, generator=g),
         "v_proj.bias": torch.randn(32, generator=g),
         "o_proj.bias": torch.randn(hidden, generator=g)}
    plan1 = LayerPlan(full, 2, (8, 8), (4, 4))
    bases = tuple([output_aware_basis(fold.group_projection(plan1, w[p], j)) for j in range(2)]
                  for p in ("k_proj", "v_proj"))
    f1 = fold.layer_factors(plan1, *bases, w["k_proj"], w["v_proj"])
    o1 = fold.folded_o_proj(plan1, w["o_proj"], f1.v_up)
    bias1 = w["o_proj.bias"] + fold.value_bias_through_o_proj(plan1, w["o_proj"],
                                                              w["v_proj.bias"])
    plan2 = LayerPlan(AttentionShape(hidden, 4, 2, d), 2, (8,), (4,))
    for rank in range(2):
        lw = local_weights(w, plan2.shape, rank, 2)
        kb, vb = local_bases(bases, 1, rank)
        f = fold.layer_factors(plan2, kb, vb, lw["k_proj"], lw["v_proj"])
        assert torch.equal(lw["q_proj"], w["q_proj"][rank * 32:(rank + 1) * 32])
        assert torch.allclose(f.a_k, f1.a_k[:, rank * 8:(rank + 1) * 8])
        assert torch.allclose(f.a_v, f1.a_v[:, rank * 4:(rank + 1) * 4])
        assert torch.allclose(f.k_up, f1.k_up[rank * 8:(rank + 1) * 8, rank * 16:(rank + 1) * 16])
        o = fold.folded_o_proj(plan2, lw["o_proj"], f.v_up)
        assert torch.allclose(o, o1[:, rank * 16:(rank + 1) * 16])  # 4 heads x rank 4
        assert "v_proj.bias" not in lw
        assert torch.allclose(lw["o_proj.bias"], bias1, atol=1e-5)
