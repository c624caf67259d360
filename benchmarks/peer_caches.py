"""vLLM 0.32's own compressed KV caches as torch round trips (issue 21).

For each built-in ``--kv-cache-dtype`` this module reproduces what vLLM stores
for a post-RoPE key and value of one token and head, and what its attention
reads back, in torch on CPU tensors, so their accuracy can be simulated where
vLLM's CPU build cannot store these formats. vLLM's own code is used wherever
it exists in Python (imported, not copied): the INT4 randomized Hadamard
transform (``single_rht``), TurboQuant's presets, Lloyd-Max centroids and
Hadamard matrix, UltraQuant's reference encoder/decoder and format constants,
the backends' slot sizes. Where vLLM only has a Triton store kernel, the
function below is a line-by-line torch port of that kernel (named in its
docstring); ``tests/kernels/test_peer_quantizers.py`` runs vLLM's kernels under
``TRITON_INTERPRET=1`` and checks the ports bit-exact against them.

Round trips (``roundtrip(dtype, k, v, layer, num_layers)``, float32
``[tokens, kv_heads, head_dim]`` in and out, in the model's basis):

- ``int8_per_token_head`` / ``fp8_per_token_head``: one float32 scale
  ``absmax / 127`` (``/ 448``) per token and head, codes ``int8`` (round half
  away from zero, then truncation by the store) or ``float8_e4m3fn``
  (``_reshape_cache_per_token_head``); read back as ``code * scale``.
- ``int4_per_token_head``: vLLM's ``single_rht`` rotation, then asymmetric
  4-bit codes with a float32 scale whose low 4 mantissa bits hold the zero
  point (``_reshape_cache_int4_kernel``); read back as
  ``(code - zp) * (scale with those bits cleared)`` in the rotated basis
  (``_attn_packed``), rotated back (``single_rht(inverse=True) / b``).
- ``turboquant_*``: keys FP8 (``k8v4``, cast without scale) or unit-norm,
  Hadamard-rotated, Lloyd-Max codes with an fp16 norm (``_tq_fused_store_mse``;
  ``_nc`` presets re-normalise the centroid vector on read); values
  asymmetric 4 / 3 bit per token and head with fp16 scale and minimum
  (``_store_quantized_value``). The first and last two attention layers stay
  in the model dtype (vLLM's boundary protection, ``get_boundary_skip_layers``).
- ``ultraquant_4bit``: FP4 E2M1 codes with one UE8M0 scale per 32 values,
  keys Hadamard-rotated by the kernel's butterfly (``_ultraquant_store_kernel``)
  then vLLM's reference encoder (``reference.ultraquant_encode``, no second
  rotation) and decoder; queries are read as FP8 E4M3 in the rotated basis
  (``query_roundtrip``). Same boundary layers as TurboQuant.
- ``nvfp4`` / ``nvfp4_4over6``: not reproduced (see :data:`UNSUPPORTED`).

Bytes per token (:func:`bytes_per_token`): each backend's
``customize_spec`` (the slot it allocates per token and head, scales
included) on vLLM's ``FullAttentionSpec``, boundary layers at 16 bits.
"""

from __future__ import annotations


import math
import os

import torch

DTYPES = ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head",
          "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
          "turboquant_3bit_nc", "ultraquant_4bit", "nvfp4", "nvfp4_4over6")

UNSUPPORTED = {
    "nvfp4": "quantized by FlashInfer's nvfp4_quantize_append_paged_kv_cache (CUDA, not in "
             "the vllm package; flashinfer is not installed here); vLLM also refuses NVFP4 "
             "at head_size 64 on SM80/90/120 (fa2 prefill)",
    "nvfp4_4over6": "same kernels as nvfp4 (CUDA only)",
}


def use_real_triton() -> None:
    """Hand vLLM the real ``triton`` where its CPU build switched Triton off
    (``vllm.triton_utils`` gives placeholders when Triton has no CPU backend),
    so that vLLM's ``@triton.jit`` kernels run under ``TRITON_INTERPRET=1`` on
    CPU tensors; vLLM kernel modules imported before are dropped, to be
    rebuilt against it on their next import. A no-op where vLLM has Triton."""
    import sys

    import vllm.triton_utils as tu

    if tu.HAS_TRITON:
        return
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    tu.HAS_TRITON, tu.triton, tu.tl, tu.tldevice = True, triton, tl, tldevice
    for name in [m for m in sys.modules if m.startswith("vllm.v1.attention.ops")]:
        del sys.modules[name]


# ---------------------------------------------------------------------------------
# per-token-head int8 / fp8 (triton_reshape_and_cache_flash._reshape_cache_per_token_head)
# ---------------------------------------------------------------------------------
def _per_token_head_scale(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
        _PER_TOKEN_HEAD_QUANT_PARAMS,
    )

    qmax, _ = _PER_TOKEN_HEAD_QUANT_PARAMS[cache_dtype]
    return torch.clamp_min(x.float().abs().amax(-1) / qmax, 1e-6)


def per_token_head_prequant(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """The float32 values the kernel stores into the ``cache_dtype`` cache
    (the store's cast is the last step)."""
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
        _PER_TOKEN_HEAD_QUANT_PARAMS,
    )

    qmax, qmin = _PER_TOKEN_HEAD_QUANT_PARAMS[cache_dtype]
    q = x.float() * (1.0 / _per_token_head_scale(x, cache_dtype))[..., None]
    if cache_dtype == torch.int8:  # round half away from zero before the store truncates
        q = torch.where(q >= 0, q + 0.5, q - 0.5)
    return torch.clamp(q, qmin, qmax)


def per_token_head_store(x: torch.Tensor, cache_dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in ``cache_dtype``, float32 scale per row) as the kernel stores
    them: int8 by truncation, fp8 by the GPU's round-to-nearest-even cast."""
    q = per_token_head_prequant(x, cache_dtype)
    q = q.trunc().to(torch.int8) if cache_dtype == torch.int8 else q.to(cache_dtype)
    return q, _per_token_head_scale(x, cache_dtype)


def per_token_head_load(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale[..., None]


# ---------------------------------------------------------------------------------
# int4 per-token-head (int4_per_token_head._reshape_cache_int4_kernel)
# ---------------------------------------------------------------------------------
def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, (x + 0.5).trunc(), (x - 0.5).trunc())


def int4_store(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(4-bit codes as uint8, packed float32 scale) of ``x`` (rotated by the
    caller with ``single_rht``), as ``_reshape_cache_int4_kernel`` stores them."""
    x = x.float()
    lo, hi = x.amin(-1), x.amax(-1)
    scale = torch.clamp_min((hi - lo) / 15.0, 1e-6)
    zp = torch.clamp(_round_half_away(-lo / scale), 0.0, 15.0)
    inv = 1.0 / scale
    s = x * inv[..., None] + zp[..., None]
    q = torch.clamp(_round_half_away(s), 0.0, 15.0).to(torch.uint8)
    bits = scale.view(torch.int32)
    packed = ((bits & -16) | (zp.to(torch.int32) & 0xF)).view(torch.float32)
    return q, packed


def int4_load(codes: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """Rotated-basis values as ``_attn_packed`` uses them: ``(code - zp) * scale``."""
    bits = packed.view(torch.int32)
    zp = (bits & 0xF).float()
    scale = (bits & -16).view(torch.float32)
    return (codes.float() - zp[..., None]) * scale[..., None]


def int4_roundtrip(x: torch.Tensor) -> torch.Tensor:
    from vllm.utils.math_utils import largest_power_of_2_divisor
    from vllm.v1.attention.ops.int4_per_token_head import single_rht

    rot = single_rht(x.float()).to(x.dtype)  # reshape_and_cache_int4
    deq = int4_load(*int4_store(rot))
    return single_rht(deq, inverse=True) / largest_power_of_2_divisor(x.shape[-1])


# ---------------------------------------------------------------------------------
# TurboQuant (triton_turboquant_store: _tq_fused_store_fp8 / _tq_fused_store_mse)
# ---------------------------------------------------------------------------------
def tq_config(dtype: str, head_dim: int):
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

    return TurboQuantConfig.from_cache_dtype(dtype, head_dim)


def tq_tables(cfg, device="cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Hadamard Pi = PiT, centroids, midpoints) as ``_ensure_on_device`` builds them."""
    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
    from vllm.v1.attention.backends.turboquant_attn import _build_hadamard

    H = _build_hadamard(cfg.head_dim, str(device))
    centroids = get_centroids(cfg.head_dim, cfg.centroid_bits).to(device=device,
                                                                   dtype=torch.float32)
    c_sorted, _ = centroids.sort()
    return H, centroids, (c_sorted[:-1] + c_sorted[1:]) / 2


def tq_value_store(v: torch.Tensor, bits: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, fp16 scale, fp16 minimum) per row (``_store_quantized_value``)."""
    v = v.float()
    lo, hi = v.amin(-1), v.amax(-1)
    scale = (hi - lo) / float(2 ** bits - 1)
    scale = torch.where(scale > 1e-8, scale, torch.full_like(scale, 1e-8))
    q = torch.clamp(((v - lo[..., None]) / scale[..., None] + 0.5).to(torch.int32),
                    0, 2 ** bits - 1)
    return q, scale.to(torch.float16), lo.to(torch.float16)


def tq_value_load(q, scale16, zero16) -> torch.Tensor:
    return q.float() * scale16.float()[..., None] + zero16.float()[..., None]


def tq_key_store(k: torch.Tensor, cfg, H: torch.Tensor, midpoints: torch.Tensor):
    """FP8 keys: the fp8 codes. MSE keys: (centroid index, fp16 norm) per row,
    the launcher's normalise + rotate GEMM then the kernel's binary search."""
    if cfg.key_fp8:  # Hopper+ (e4nv, cvt.rn.satfinite); Ampere/Ada use e4b15
        return (k.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn),)
    k = k.float()
    shape = k.shape
    flat = k.reshape(-1, shape[-1])
    norms = flat.norm(dim=1, keepdim=True)
    y = (flat / (norms + 1e-8)) @ H
    idx = torch.bucketize(y, midpoints, right=True)  # count of midpoints <= y
    idx = torch.clamp_max(idx, cfg.n_centroids - 1)
    return idx.reshape(shape), norms.reshape(shape[:-1]).to(torch.float16)


def tq_key_load_rotated(stored, cfg, centroids: torch.Tensor) -> torch.Tensor:
    """Keys as the decode kernel scores them (rotated basis for MSE keys)."""
    if cfg.key_fp8:
        return stored[0].float()
    idx, norm16 = stored
    c = centroids[idx]
    if cfg.norm_correction:
        c = c * (1.0 / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-16))
    return norm16.float()[..., None] * c


def tq_roundtrip(dtype: str, k: torch.Tensor, v: torch.Tensor):
    cfg = tq_config(dtype, k.shape[-1])
    H, centroids, midpoints = tq_tables(cfg, k.device)
    k_hat = tq_key_load_rotated(tq_key_store(k, cfg, H, midpoints), cfg, centroids)
    if not cfg.key_fp8:  # q_rot = q @ PiT against rotated keys == q against k_rot @ Pi
        k_hat = k_hat @ H
    v_hat = tq_value_load(*tq_value_store(v, cfg.value_quant_bits))
    return k_hat, v_hat


# ---------------------------------------------------------------------------------
# UltraQuant (ultraquant.triton_store._ultraquant_store_kernel, ultraquant.reference)
# ---------------------------------------------------------------------------------
def uq_rotate(x: torch.Tensor) -> torch.Tensor:
    """The store kernel's in-register Walsh-Hadamard butterfly (orthonormal,
    ``(sign * x + x[i ^ bit]) * 1/sqrt(2)`` per stage, in float32)."""
    x = x.float()
    d = x.shape[-1]
    idx = torch.arange(d, device=x.device)
    inv_sqrt2 = torch.tensor(0.7071067811865476, dtype=torch.float32, device=x.device)
    for stage in range(int(d).bit_length() - 1):
        bit = 1 << stage
        partner = x[..., idx ^ bit]
        sign = torch.where((idx & bit) == 0, 1.0, -1.0).to(torch.float32)
        x = (sign * x + partner) * inv_sqrt2
    return x


def uq_roundtrip(k: torch.Tensor, v: torch.Tensor):
    from vllm.v1.attention.ops.ultraquant.reference import (
        ultraquant_dequant,
        ultraquant_encode,
    )

    d = k.shape[-1]
    k_rot = ultraquant_dequant(ultraquant_encode(uq_rotate(k), rotate=False), d)
    v_hat = ultraquant_dequant(ultraquant_encode(v.float(), rotate=False), d)
    return uq_rotate(k_rot), v_hat  # the butterfly is its own inverse


def uq_query(q: torch.Tensor) -> torch.Tensor:
    """Queries as UltraQuant's attention reads them: Hadamard-rotated, cast to
    FP8 E4M3 (the launcher's ``q_rot.to(torch.float8_e4m3fn)``), in the model basis."""
    from vllm.v1.attention.ops.ultraquant.reference import hadamard_matrix

    H = hadamard_matrix(q.shape[-1], q.device, torch.float32)
    return ((q.float() @ H.T).to(torch.float8_e4m3fn).float()) @ H


# ---------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------
def skipped_layers(dtype: str, num_layers: int) -> set[int]:
    """Layers vLLM keeps in the model dtype (TurboQuant / UltraQuant boundary
    protection: ``TurboQuantConfig.get_boundary_skip_layers`` for dense models)."""
    if not (dtype.startswith("turboquant_") or dtype == "ultraquant_4bit"):
        return set()
    n = min(2, num_layers // 2)  # get_boundary_skip_layers(n=2), dense model
    return set(range(n)) | set(range(num_layers - n, num_layers))


def roundtrip(dtype: str, k: torch.Tensor, v: torch.Tensor, layer: int = 0,
              num_layers: int = 1_000_000) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as ``dtype``'s attention reads them back ([..., D])."""
    if dtype in UNSUPPORTED:
        raise NotImplementedError(f"{dtype}: {UNSUPPORTED[dtype]}")
    if layer in skipped_layers(dtype, num_layers):
        return k, v
    if dtype in ("int8_per_token_head", "fp8_per_token_head"):
        from vllm.platforms import current_platform

        cd = torch.int8 if dtype.startswith("int8") else current_platform.fp8_dtype()
        return (per_token_head_load(*per_token_head_store(k, cd)),
                per_token_head_load(*per_token_head_store(v, cd)))
    if dtype == "int4_per_token_head":
        return int4_roundtrip(k), int4_roundtrip(v)
    if dtype.startswith("turboquant_"):
        return tq_roundtrip(dtype, k, v)
    if dtype == "ultraquant_4bit":
        return uq_roundtrip(k, v)
    raise ValueError(dtype)


def query_roundtrip(dtype: str, q: torch.Tensor, layer: int = 0,
                    num_layers: int = 1_000_000) -> torch.Tensor:
    """Queries as the format's attention reads them (FP8 for UltraQuant)."""
    if dtype == "ultraquant_4bit" and layer not in skipped_layers(dtype, num_layers):
        return uq_query(q)
    return q


def slot_bytes(dtype: str, num_kv_heads: int, head_dim: int) -> int:
    """Bytes per token of one quantized layer: the backend's ``customize_spec``
    on vLLM's ``FullAttentionSpec`` (block size 1), scales included."""
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE, nvfp4_kv_cache_full_dim
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    spec = FullAttentionSpec(block_size=1, num_kv_heads=num_kv_heads, head_size=head_dim,
                             dtype=STR_DTYPE_TO_TORCH_DTYPE[dtype],
                             kv_quant_mode=get_kv_quant_mode(dtype))
    if dtype.endswith("per_token_head"):
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

        spec = TritonAttentionBackend.customize_spec(spec)
    elif dtype.startswith("turboquant_"):
        from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend

        spec = TurboQuantAttentionBackend.customize_spec(spec)
    elif dtype == "ultraquant_4bit":
        # UltraQuantAttentionBackend.customize_spec (its module imports Triton
        # kernels that need a GPU Triton here): state_content_bytes = slot_size(D)
        from dataclasses import replace

        from vllm.v1.attention.ops.ultraquant.format import slot_size

        spec = replace(spec, state_content_bytes=slot_size(head_dim))
    elif dtype.startswith("nvfp4"):
        # FlashInferBackend.customize_spec (flashinfer.py imports the flashinfer
        # package, absent here): 2 * H slots of nvfp4_kv_cache_full_dim bytes
        from dataclasses import replace

        spec = replace(spec, num_head_slots=2 * num_kv_heads,
                       state_content_bytes=nvfp4_kv_cache_full_dim(head_dim)
                       * spec.dtype.itemsize)
    else:
        raise ValueError(dtype)
    return spec.page_size_bytes


def bytes_per_token(dtype: str, num_layers: int, num_kv_heads: int,
                    head_dim: int) -> tuple[int, int]:
    """(16-bit K+V bytes, allocated bytes) per token over all layers; boundary
    layers that vLLM keeps unquantized count at 16 bits. vLLM pads those
    layers' pages to the shared page (``skip_page_size_padded``); that padding
    depends on block sizes and is not counted."""
    full = 2 * num_kv_heads * head_dim * 2
    skipped = skipped_layers(dtype, num_layers)
    quant = slot_bytes(dtype, num_kv_heads, head_dim)
    return full * num_layers, full * len(skipped) + quant * (num_layers - len(skipped))


def compression_ratio(dtype: str, num_layers: int, num_kv_heads: int, head_dim: int) -> float:
    a, b = bytes_per_token(dtype, num_layers, num_kv_heads, head_dim)
    return a / b


# ---------------------------------------------------------------------------------
# Accuracy, simulated (Hugging Face float32 model, same held-out windows)
# ---------------------------------------------------------------------------------
def _nll(model, ids: torch.Tensor, chunk: int = 512) -> tuple[float, int]:
    """Summed next-token negative log-likelihood of one window (logits in chunks)."""
    with torch.no_grad():
        h = model.model(ids[None]).last_hidden_state[0]
        nll = 0.0
        for s in range(0, len(ids) - 1, chunk):
            e = min(s + chunk, len(ids) - 1)
            logits = model.lm_head(h[s:e]).float()
            nll += torch.nn.functional.cross_entropy(logits, ids[s + 1:e + 1],
                                                     reduction="sum").item()
    return nll, len(ids) - 1


def install(model, state: dict) -> None:
    """Route ``model``'s attention through the format in ``state["dtype"]``
    (``None``: unquantized): post-RoPE keys and values (and UltraQuant's
    queries) of every token are replaced by what the cache reads back, then
    PyTorch SDPA attends over them."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    num_layers = model.config.num_hidden_layers

    def peer_attention(module, q, k, v, mask, **kw):
        dtype = state["dtype"]
        if dtype is not None:
            layer = module.layer_idx
            k, v = roundtrip(dtype, k, v, layer, num_layers)
            q = query_roundtrip(dtype, q, layer, num_layers)
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("peer_kv", peer_attention)
    model.set_attn_implementation("peer_kv")


def evaluate(model_name: str, dtypes: list[str], texts: list[str], windows: int,
             context: int, out: str | None) -> dict:
    """Perplexity per text of each dtype (and ``"uncompressed"``) on
    ``windows`` held-out windows of ``context`` tokens per text (the frontier's
    ``eval_windows``); writes and resumes from ``out`` (JSON)."""
    import json
    import os
    import time

    from vllm_lowrank.calibration.calibrate import load_hf_model
    from vllm_lowrank.cli import resolve_model
    from vllm_lowrank.evaluation import eval_windows

    results = json.load(open(out)) if out and os.path.exists(out) else {}
    model, tok = load_hf_model(resolve_model(model_name))
    state = {"dtype": None}
    install(model, state)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    data = {t: [torch.tensor(w) for w in eval_windows(tok, t, windows, context)] for t in texts}
    for name in ["uncompressed", *dtypes]:
        key = f"{name}|{windows}x{context}"
        if key in results:
            continue
        state["dtype"] = None if name == "uncompressed" else name
        t0 = time.time()
        r = {}
        for t in texts:
            per_window = [_nll(model, ids) for ids in data[t]]
            nll, n = sum(a for a, _ in per_window), sum(b for _, b in per_window)
            r[t] = {"ppl": math.exp(nll / n), "nll": nll, "tokens": n,
                    "windows": per_window}
        r["seconds"] = time.time() - t0
        if name != "uncompressed":
            o, a = bytes_per_token(name, cfg.num_hidden_layers, cfg.num_key_value_heads,
                                   head_dim)
            r["bytes_16bit"], r["bytes"] = o, a
        results[key] = r
        print(f"{name}: " + ", ".join(f"{t} {r[t]['ppl']:.3f}" for t in texts)
              + f" ({r['seconds']:.0f} s)", flush=True)
        if out:
            with open(out, "w") as f:
                json.dump(results, f, indent=1)
    return results


def vllm_check(model_name: str, dtype: str, texts: list[str], windows: int, context: int,
               step: int = 32, block_size: int = 32, passkey_cases: int = 0) -> dict:
    """The same simulation inside vLLM's CPU engine (the frontier's
    generate-style protocol): ``Attention.forward`` gets the format's keys,
    values (and queries) before vLLM caches and attends them, so a prefill
    chunk also attends its own keys and values as stored (vLLM's kernels
    attend a chunk's fresh keys unquantized in some of these formats: here at
    worst a pessimistic bias). In this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); checks that the Hugging Face
    simulation measures what the serving path would. ``passkey_cases > 0``:
    also the passkey retrieval of :mod:`vllm_lowrank.passkey` at ``context``
    tokens (``result["passkey"]``), as ``benchmarks/passkey.py`` runs it for
    our presets."""
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.models.utils import extract_layer_index

    from vllm_lowrank.cli import resolve_model
    from vllm_lowrank.evaluation import _worker

    model = resolve_model(model_name)
    import transformers

    num_layers = transformers.AutoConfig.from_pretrained(model).num_hidden_layers
    forward = Attention.forward

    def peer_forward(self, query, key, value, *a, **kw):
        layer = extract_layer_index(self.layer_name)
        t, d = key.shape[0], self.head_size
        k, v = roundtrip(dtype, key.view(t, -1, d), value.view(t, -1, d), layer, num_layers)
        q = query_roundtrip(dtype, query.view(t, -1, d), layer, num_layers)
        return forward(self, q.reshape(query.shape).to(query.dtype),
                       k.reshape(key.shape).to(key.dtype),
                       v.reshape(value.shape).to(value.dtype), *a, **kw)

    Attention.forward = peer_forward
    spec = {"model": model, "compression": None, "texts": texts, "num_windows": windows,
            "window": context, "block_size": block_size,
            "passkey": ({"num_cases": passkey_cases, "context_tokens": context}
                        if passkey_cases else None),
            "step_tokens": step}
    return _worker(spec)


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtypes", nargs="+", default=[d for d in DTYPES if d not in UNSUPPORTED])
    p.add_argument("--texts", nargs="*", default=["wikipedia", "bbc"])
    p.add_argument("--windows", type=int, default=2, help="windows per text")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--json", default=None, help="write (and resume from) every number")
    p.add_argument("--bytes", action="store_true", help="only print bytes per token")
    p.add_argument("--vllm-check", default=None, metavar="DTYPE",
                   help="simulate DTYPE inside vLLM's CPU engine instead (generate-style)")
    p.add_argument("--passkey", type=int, default=0, metavar="CASES",
                   help="with --vllm-check: passkey retrieval, CASES prompts of --context "
                        "tokens (give --texts with no name to skip perplexity)")
    args = p.parse_args()
    if args.vllm_check:
        r = vllm_check(args.model, args.vllm_check, args.texts, args.windows, args.context,
                       passkey_cases=args.passkey)
        print(args.vllm_check, "through vLLM:", {t: round(r[t]["ppl"], 3) for t in args.texts},
              {t: round(r[t]["seconds"]) for t in args.texts}, flush=True)
        if args.passkey:
            pk = r["passkey"]
            depths = " / ".join(f"{v:.2f}" for v in pk["by_depth"].values())
            print(f"| {args.vllm_check} (simulated) | {args.context} | {pk['accuracy']:.2f} | "
                  f"{round(pk['accuracy'] * pk['cases'])}/{pk['cases']} | {depths} |",
                  flush=True)
        os._exit(0)  # vLLM's CPU build may abort in its own teardown
    if args.bytes:  # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64
        for d in DTYPES:
            o, a = bytes_per_token(d, 30, 3, 64)
            print(f"{d:22s} slot {slot_bytes(d, 3, 64):4d} B/token/layer  "
                  f"model {a} of {o} B/token  {o / a:.2f}x")
        return
    torch.set_num_threads(2)
    res = evaluate(args.model, args.dtypes, args.texts, args.windows, args.context, args.json)
    base = res[f"uncompressed|{args.windows}x{args.context}"]
    print(f"\n{args.windows} x {args.context} held-out tokens per text (simulated storage)\n")
    print("| kv-cache-dtype | bytes / token (of 16-bit K+V) | compression | "
          + " | ".join(f"{t} ppl" for t in args.texts) + " | mean change |")
    print("|---|---|---|" + "---|" * len(args.texts) + "---|")
    for name in ["uncompressed", *args.dtypes]:
        r = res[f"{name}|{args.windows}x{args.context}"]
        d = [100 * (r[t]["ppl"] / base[t]["ppl"] - 1) for t in args.texts]
        ratio = r["bytes_16bit"] / r["bytes"] if "bytes" in r else 1.0
        cells = " | ".join(f"{r[t]['ppl']:.3f}" + (f" ({x:+.2f} %)" if r is not base else "")
                           for t, x in zip(args.texts, d))
        mean = "" if r is base else f"{sum(d) / len(d):+.2f} %"
        print(f"| {name} | {1 / ratio:.3f} | {ratio:.2f}x | {cells} | {mean} |")


if __name__ == "__main__":
    main()
