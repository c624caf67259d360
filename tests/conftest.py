"""Shared fixtures: the embedded model and engine builders.

Tests marked ``slow`` start vLLM engines or servers (about 30 s each on 2 CPU
cores); engines are shared per module through module-scoped fixtures.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def model_path() -> str:
    """The converted SmolLM2-135M-Instruct folder (converted once, cached)."""
    from vllm_lowrank import embedded

    return embedded.prepare()


def make_llm(model: str, compression: dict | None = None, **kwargs):
    """A ``vllm.LLM`` on CPU, float32 (4x faster than bf16 on AVX2), eager."""
    from vllm import LLM

    args = dict(model=model, dtype="float32", enforce_eager=True, max_model_len=2048,
                seed=0)
    args.update(kwargs)
    if compression is not None:
        args["additional_config"] = {"kv_compression": compression}
    return LLM(**args)
