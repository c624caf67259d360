"""Presets served by vLLM (:mod:`vllm_lowrank.presets`): the ``8x`` preset
allocates ranks and bits on first start, caches the allocation and loads it on
the next start; it stores latents at >= 7.5x and still answers."""

from __future__ import annotations

import gc
import glob
import os

import pytest

from conftest import clear_worker_states, make_llm, worker_states

pytestmark = pytest.mark.slow

LAYERS, KV_WIDTH = 30, 3 * 64


def _serve(model_path, compression):
    from vllm import SamplingParams

    clear_worker_states()
    llm = make_llm(model_path, compression, block_size=32)
    out = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    states = worker_states()
    del llm
    gc.collect()
    return out[0].outputs[0].text, states[0]


def test_8x_preset_allocates_once_caches_and_answers(model_path):
    from vllm_lowrank.calibration.cache import cache_root

    pattern = os.path.join(cache_root(), "artifacts", "*-alloc8-b32-*")
    for path in glob.glob(pattern):  # a cached allocation from an earlier run: keep it
        assert os.path.isdir(path) or path.endswith(".lock")
    text, state = _serve(model_path, {"mode": "lowrank", "preset": "8x"})
    made = [p for p in glob.glob(pattern) if os.path.isdir(p)]
    assert len(made) == 1, made
    mtime = os.path.getmtime(os.path.join(made[0], "manifest.json"))
    assert "Paris" in text, text
    layers = state["layers"]
    assert {tuple(la["bits"]) for la in layers.values()} != {(4, 4)}  # bits per layer
    original = LAYERS * 2 * KV_WIDTH * 2  # 16-bit K + V bytes per token
    assert original / state["stored_bytes_per_token"] >= 7.5
    assert state["exact_tokens"] == {"sink": 32, "recent": 256, "bits": 8}
    # the second start loads the cached allocation: same ranks, nothing rewritten
    text2, state2 = _serve(model_path, {"mode": "lowrank", "preset": "8x"})
    assert state2["layers"] == layers and text2 == text
    assert os.path.getmtime(os.path.join(made[0], "manifest.json")) == mtime
