"""Every supported architecture at ratio 1.0 gives the stock engine's greedy
tokens (issue 7).

Qwen2 (q/k/v biases), Qwen3 (QK-norm) and Mistral (sliding window) run as small
random-weight models built here with transformers' own config classes and the
embedded SmolLM2 tokenizer; biases and norm weights are drawn at random so the
paths that handle them are exercised (a zero bias or a unit norm weight would
hide a dropped one). The real Gemma-3 is in ``test_gemma3.py``; Llama (SmolLM2)
in ``test_engine.py``.
"""

from __future__ import annotations

import gc

import pytest

from conftest import (
    assert_same_until_tie,
    clear_worker_states,
    greedy_with_gaps,
    make_llm,
    worker_states,
)

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    # longer than the Mistral model's 32-token window, with the generated tail
    "In the beginning of the nineteenth century, the small harbour town was known "
    "mostly for its fishing fleet, its salt works and a lighthouse that",
]
STEPS = 24


def _config(arch: str, vocab: int, tok):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=0.2,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  tie_word_embeddings=False)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=48, **common)
    return transformers.MistralConfig(head_dim=32, sliding_window=32, **common)


def _build(arch: str, folder: str, tokenizer_path: str) -> str:
    """Random-weight model of ``arch`` saved to ``folder`` (float32)."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_path)
    config = _config(arch, len(tok), tok)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _run(folder: str, compression: dict | None):
    """(greedy tokens and gaps, the worker's published compression state or ``None``)."""
    clear_worker_states()
    llm = make_llm(folder, compression, max_model_len=512)
    result = greedy_with_gaps(llm, PROMPTS, STEPS, ignore_eos=True)
    states = worker_states()
    del llm
    gc.collect()
    return result, (states[0] if states else None)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_ratio_one_matches_stock_engine(arch, model_path, tmp_path_factory):
    """Pre-RoPE latents (key bias / QK-norm applied at the rebuild) and
    post-RoPE latents (the default preset's method: bias and norm before the
    projection) at full rank give the stock engine's greedy tokens."""
    folder = _build(arch, str(tmp_path_factory.mktemp(arch)), model_path)
    (stock, gaps), off = _run(folder, None)
    assert off is None  # compression off: the stock model, nothing published
    for compression in ({"rank_fraction": 1.0},
                        {"rank_fraction": 1.0, "head_group_size": 1, "method": "post_rope",
                         "rank_allocation": "uniform"}):
        (latent, _), on = _run(folder, compression)
        assert on is not None and on["enabled"] and len(on["layers"]) == 3  # latent path ran
        assert_same_until_tie(latent, stock, gaps, len(PROMPTS) * STEPS // 2,
                              f"{arch} {compression}")
