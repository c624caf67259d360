"""The CPU-checkable parts of tensor parallelism in the GPU benchmark and the
GPU engine probe (``benchmarks/gpu_serving.py``, ``tests/gpu_engine/probe.py``):
named model shapes, the engine arguments at TP=2, the ``8x`` stand-in's ranks
split over two ranks, the capacity the README expects for the 70B shape, and
the probe's random checkpoint (the model every TP size loads)."""

from __future__ import annotations

import json
import os
import sys

import pytest
from conftest import RECIPE_8B, REPO, benchmark_module

gs = benchmark_module("gpu_serving")
allocations = benchmark_module("allocations")


@pytest.fixture
def recipe(tmp_path, monkeypatch):
    """A recipe model folder ``llama3-8b-shape`` under ``GPUVLLM_MODELS``; the
    copies go to ``tmp_path``."""
    folder = tmp_path / "models" / "llama3-8b-shape"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(RECIPE_8B))
    monkeypatch.setenv("GPUVLLM_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    return folder


def _config(folder: str) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def test_named_shapes_copy_the_recipe_with_their_overrides(recipe):
    got = _config(gs.model_dir("llama3-70b-shape", max_position_embeddings=131088))
    assert got == {**RECIPE_8B, "hidden_size": 8192, "num_attention_heads": 64,
                   "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 28672,
                   "num_hidden_layers": 80, "max_position_embeddings": 131088}
    assert _config(gs.model_dir("llama3-70b-width-8l"))["num_hidden_layers"] == 8
    plain = gs.model_dir("llama3-8b-shape", max_position_embeddings=16384)
    assert os.path.basename(plain) == "llama3-8b-shape-max_position_embeddings16384"
    assert _config(plain) == {**RECIPE_8B, "max_position_embeddings": 16384}


def test_parallel_args_and_environment():
    assert gs.parallel_args(1) == {}
    assert gs.parallel_args(2) == {"tensor_parallel_size": 2,
                                   "distributed_executor_backend": "mp",
                                   "disable_custom_all_reduce": True}
    assert gs.NO_MULTICAST["NCCL_NVLS_ENABLE"] == "0"
    assert gs.NO_MULTICAST["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0"


def _estimate(recipe, config: dict, tp: int, **kw) -> dict:
    from vllm_lowrank.config import LowRankConfig
    from vllm_lowrank.estimate import estimate

    cfg = LowRankConfig.from_dict({"mode": "lowrank", "artifact": "none", **config})
    return estimate(str(recipe), cfg, tensor_parallel_size=tp, **kw)


def test_alloc_8x_tp2_splits_into_packable_shares(recipe):
    """The ``8x`` stand-in's ranks, scaled in multiples of 8, leave a rank a
    share of 84 channels at TP=2, which the config refuses (4-bit codes pack in
    whole bytes per group of 8 channels); the ``tp=2``
    ranks (multiples of 16) serve at TP=2, each rank storing about half of
    TP=1's bytes."""
    from vllm_lowrank.presets import PRESETS

    one = gs.CONFIGS["alloc-8x"]["compression"]
    two = gs.CONFIGS["alloc-8x-tp2"]["compression"]
    assert all(r % 16 == 0 for pair in two["ranks"].values() for r in pair)
    assert two["ranks"] == allocations.alloc_8x_ranks(32, 1024, tp=2)
    assert one["ranks"] == allocations.alloc_8x_ranks(32, 1024)  # unchanged at TP=1
    with pytest.raises(ValueError, match="gives 84 per head group .* not a multiple of 8"):
        _estimate(recipe, one, 2, block_size=32)
    tp1 = _estimate(recipe, two, 1, block_size=32)
    tp2 = _estimate(recipe, two, 2, block_size=32)
    # half per rank, up to the slot padding (every layer's slot is the widest's)
    assert tp2["stored_bytes_per_token"] * 2 == pytest.approx(tp1["stored_bytes_per_token"],
                                                              rel=0.02)
    assert PRESETS["8x"].block_size == 32


def test_70b_shape_capacity_at_tp2(recipe):
    """What ``llama3-70b-shape`` is expected to hold at TP=2, 50 GiB of KV cache
    per GPU, 128k-token sequences: stock 2 sequences, the default 6."""
    folder = gs.model_dir("llama3-70b-shape", max_position_embeddings=131088)
    info = _estimate(folder, {"preset": "2x"}, 2, kv_cache_gib=50, context=131072)
    assert info["original_bytes_per_token"] == 80 * 2 * 4 * 128 * 2  # 160 KiB per rank
    assert info["stock_tokens"] == 327_680 and info["stock_sequences"] == 2
    assert info["tokens"] == 838_848 and info["sequences"] == 6


def test_probe_random_checkpoint_is_a_llama_state_dict(recipe, tmp_path):
    """Every tensor of the Llama model under its Hugging Face name and shape,
    bf16, seeded (the same bytes twice), norms 1."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO / "tests" / "gpu_engine"))
    try:
        import probe
    finally:
        sys.path.remove(str(REPO / "tests" / "gpu_engine"))
    small = dict(RECIPE_8B, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_hidden_layers=2, vocab_size=128)
    src = tmp_path / "small"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(small))
    got = load_file(os.path.join(probe.random_checkpoint(str(src)), "model.safetensors"))
    with torch.device("meta"):
        want = LlamaForCausalLM(LlamaConfig(**small)).state_dict()
    assert {k: tuple(v.shape) for k, v in got.items()} == \
        {k: tuple(v.shape) for k, v in want.items()}
    assert all(v.dtype == torch.bfloat16 for v in got.values())
    assert torch.equal(got["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert 0.015 < got["lm_head.weight"].float().std() < 0.025
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(small))
    again = load_file(os.path.join(probe.random_checkpoint(str(other)), "model.safetensors"))
    assert all(torch.equal(got[k], again[k]) for k in got)


@pytest.mark.parametrize("version", ["0.32", "0.33"])
def test_the_recipe_patch_sends_the_tp_embedding_to_torch(version):
    """``benchmarks/gpuvllm_tp.py`` applies to vLLM 0.32 and 0.33, and with the
    recipe's stub (no compiled ``vocab_parallel_embedding``) vLLM's choice of the
    fused lookup at TP=2 on CUDA comes out ``False`` (its torch path), while with
    the op present it stays ``True``: vLLM's own expression, evaluated as patched."""
    import ast
    import types

    vllm = pytest.importorskip("vllm")
    from conftest import release_sources

    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpuvllm_flashinfer
    import gpuvllm_tp

    try:
        root = (os.path.dirname(vllm.__file__) if version == "0.32"
                else str(release_sources("0.33.0") / "vllm"))
    except RuntimeError as exc:  # no wheel and no network
        pytest.skip(str(exc))
    with open(os.path.join(root, gpuvllm_tp.EMBEDDING)) as f:
        text = gpuvllm_flashinfer.patch_text(gpuvllm_tp.EMBEDDING, f.read(), gpuvllm_tp.PATCHES)
    (expr,) = [node.value for node in ast.walk(ast.parse(text))
               if isinstance(node, ast.Assign)
               and any(ast.unparse(t) == "self.use_fused_embedding" for t in node.targets)]

    class Unquantized:
        pass

    def fused(ops_c) -> bool:
        env = {"self": types.SimpleNamespace(tp_size=2), "Unquantized": Unquantized,
               "current_platform": types.SimpleNamespace(is_cuda=lambda: True),
               "quant_method": Unquantized(), "UnquantizedEmbeddingMethod": Unquantized,
               "torch": types.SimpleNamespace(ops=types.SimpleNamespace(_C=ops_c))}
        return eval(compile(ast.Expression(expr), "<patched>", "eval"), env)

    assert fused(types.SimpleNamespace()) is False  # the stub: hasattr answers False
    assert fused(types.SimpleNamespace(vocab_parallel_embedding=print)) is True
