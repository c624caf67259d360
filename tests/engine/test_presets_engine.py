"""Presets served by vLLM (:mod:`vllm_lowrank.presets`): the ``8x`` preset
calibrates on its text (the mix) and allocates ranks and bits on first start,
caches the allocation and loads it on the next start; it stores latents at >=
7.5x and still answers.

The test gives ``calibration_tokens`` (the suite's
:data:`conftest.CALIBRATION_TOKENS`, a key the user may override) beside the
preset to keep the first start short; the prompt and its answer lie inside the
exact recent window, so the answer does not depend on the calibration. The
preset's own 65,536 tokens are measured by ``benchmarks/frontier.py --only
"preset 8x"``."""

from __future__ import annotations

import gc
import glob
import json
import os

import pytest

from conftest import CALIBRATION_TOKENS, calibrated, clear_worker_states, make_llm, worker_states

from vllm_lowrank.calibration.text import CALIBRATION_TEXTS
from vllm_lowrank.presets import PRESETS

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
    from vllm_lowrank.calibration.cache import auto_artifact_path
    from vllm_lowrank.config import LowRankConfig

    compression = calibrated({"mode": "lowrank", "preset": "8x"})
    # this setting's calibration, and its allocations beside it (one from an
    # earlier run is kept: then this start loads it)
    base = auto_artifact_path(model_path, LowRankConfig.from_dict(compression))
    pattern = base + "-alloc8-b32-*"
    text, state = _serve(model_path, compression)
    made = [p for p in glob.glob(pattern) if os.path.isdir(p)]
    assert len(made) == 1, made
    mtime = os.path.getmtime(os.path.join(made[0], "manifest.json"))
    with open(os.path.join(made[0], "manifest.json")) as f:
        calibration = json.load(f)["calibration"]
    assert calibration["text"] == CALIBRATION_TEXTS[PRESETS["8x"].settings["calibration_text"]]
    assert calibration["tokens"] == CALIBRATION_TOKENS
    assert "Paris" in text, text
    layers = state["layers"]
    assert {tuple(la["bits"]) for la in layers.values()} != {(4, 4)}  # bits per layer
    original = LAYERS * 2 * KV_WIDTH * 2  # 16-bit K + V bytes per token
    assert original / state["stored_bytes_per_token"] >= 7.5
    assert state["exact_tokens"] == {"sink": 32, "recent": 256, "bits": 8}
    # the second start loads the cached allocation: same ranks, nothing rewritten
    text2, state2 = _serve(model_path, compression)
    assert state2["layers"] == layers and text2 == text
    assert os.path.getmtime(os.path.join(made[0], "manifest.json")) == mtime
