"""Perplexity cost of an FP8 (E4M3) KV cache, simulated, as the reference point
for quantized latents where vLLM's own ``--kv-cache-dtype fp8`` cannot run.

vLLM's CPU backend needs AVX-512 or AMX for an FP8 KV cache
(``vllm/v1/attention/backends/cpu_attn.py``); on other CPUs this script
reproduces what that cache stores: post-RoPE keys and values cast to
``torch.float8_e4m3fn`` with scale 1.0 (vLLM's default without calibrated
scales) and back, in a Hugging Face float32 model, on the same held-out windows
as ``vllm-lowrank perplexity`` (``eval_windows``). Prints baseline and FP8
perplexity per text.

    .venv/bin/python -P benchmarks/fp8_reference.py --text wikipedia bbc --tokens 4096
"""

from __future__ import annotations

import argparse
import math

import torch


def _perplexity(model, windows: list[list[int]]) -> float:
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w])
            logits = model(ids, use_cache=False).logits[0, :-1].float()
            nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += len(w) - 1
    return math.exp(nll / count)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", nargs="+", default=["wikipedia", "bbc"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=1024)
    args = p.parse_args()

    import transformers.models.llama.modeling_llama as llama

    from vllm_lowrank.calibration.calibrate import load_hf_model
    from vllm_lowrank.cli import resolve_model
    from vllm_lowrank.evaluation import eval_windows

    model, tok = load_hf_model(resolve_model(args.model))
    fp8 = {"on": False}

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float8_e4m3fn).to(t.dtype) if fp8["on"] else t

    rope = llama.apply_rotary_pos_emb

    def rope_then_cast(q, k, cos, sin, *a, **kw):
        q, k = rope(q, k, cos, sin, *a, **kw)
        return q, cast(k)

    llama.apply_rotary_pos_emb = rope_then_cast  # keys as the cache holds them
    for layer in model.model.layers:
        layer.self_attn.v_proj.register_forward_hook(lambda _m, _a, out: cast(out))

    print(f"FP8 E4M3 KV cache (simulated), {args.tokens} held-out tokens per text")
    print("| text | baseline ppl | fp8 ppl | delta |")
    print("|---|---|---|---|")
    for text in args.text:
        windows = eval_windows(tok, text, max(1, args.tokens // args.window), args.window)
        fp8["on"] = False
        base = _perplexity(model, windows)
        fp8["on"] = True
        quant = _perplexity(model, windows)
        print(f"| {text} | {base:.3f} | {quant:.3f} | {100 * (quant / base - 1):+.2f} % |",
              flush=True)


if __name__ == "__main__":
    main()
