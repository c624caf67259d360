"""vLLM 0.32's own decode attention on its own compressed KV caches, against
ours (issue 21, item 3: "their decode speed against ours").

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, bf16
queries), one decode token per sequence, every sequence at full length, paged
caches of 16-token blocks with shuffled block tables (as
``decode_attention.make_problem`` draws them), timed in the harness of
``benchmarks/decode_attention.py`` (CUDA-graph replay, L2 flushed before each
replay). Each vLLM format is set up as its backend does it, with vLLM's own
code: the spec and slot size (``customize_spec``), the cache view vLLM
allocates (``create_kv_cache_views``, its default NHD layout), vLLM's store
kernel for the format fed random N(0, 1) bf16 keys and values (the same ones
for every format), then the backend's decode call:

- ``stock`` / ``*_per_token_head``: the TRITON_ATTN backend's own
  ``TritonAttentionImpl``: ``do_kv_cache_update`` (per-token-head Triton
  store; the bf16 cache is a plain copy, written with torch indexing: vLLM's
  ``triton_reshape_and_cache_flash`` asks CUDA for the device capability) and
  ``forward`` with decode metadata as its metadata builder makes it
  (``unified_attention``, the 3D split-softmax kernel up to 16 sequences,
  ``unified_attention_int4`` for int4);
- ``turboquant_*``: ``triton_turboquant_store`` and
  ``triton_turboquant_decode_attention`` with the arguments
  ``TurboQuantAttentionImpl`` passes (its preset config, Hadamard rotation,
  centroids and midpoints via ``peer_caches.tq_tables``, the split count of
  ``AttentionConfig.tq_max_kv_splits_for_cuda_graph``, scratch buffers of the
  workspace's shapes);
- ``ours``: the ``2x`` preset's format (post-RoPE latents at full rank, 8-bit
  keys and 4-bit values per token) through ``decode_attention.run_case``
  in ``post_rope`` mode, as its ``--packed-sweep`` runs it.

Columns:
  B/token     bytes per token and layer from the format's slot (scales and
              padding included; ours: ``SlotLayout.slot_bytes``)
  vs bf16     compression: 16-bit K+V bytes (4,096) / B/token
  us          median time of one decode-attention call (``time_graph``)
  x sdpa      torch SDPA over contiguous bf16 K/V (``sdpa_case``) / us
  x stock     vLLM's bf16 unified attention (``stock``) / us
  GB/s        cache bytes of the attended tokens / us
  rel         ||out - ref|| / ||ref||, ref = float32 attention over the keys
              and values the format stores, read back from its cache: bf16
              as is; int8 / fp8 codes x their float32 scale; int4 nibbles
              with the scale and zero point packed in one float32
              (``peer_caches.int4_load``) in the randomized-Hadamard basis,
              query rotated and output rotated back with vLLM's
              ``single_rht``; TurboQuant through vLLM's own dequant kernel
              ``_tq_full_dequant_kv`` (keys in the rotated basis, query
              rotated by the Hadamard matrix); ours ``decode_attention.
              reference`` (the slots decoded). So ``rel`` is the kernel's
              own error, not the format's quantization error
  note        the error of a format that failed (the other rows still run)

Usage (GPU machine, vLLM's Python sources and Triton, no compiled vLLM ops)::

    source .gpuvllm/env.sh && python3 -P benchmarks/peer_decode.py
    source .gpuvllm/env.sh && python3 -P benchmarks/peer_decode.py --shapes 16x32k \\
        --formats stock,int4_per_token_head,ours --json out/peer_decode.json

CPU check of every row's setup, store, decode call and ``rel`` (Triton
interpreter, tiny shapes, one plain call timed with ``time.perf_counter``, no
SDPA row; float16 model dtype: the Triton 3.9 interpreter computes ``tl.dot``
of bf16 operands wrong)::

    TRITON_INTERPRET=1 .venv/bin/python -P benchmarks/peer_decode.py --smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pathlib
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import decode_attention as da  # noqa: E402
import peer_caches as pc  # noqa: E402

from vllm_lowrank.presets import PRESETS  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = da.HEADS, da.KV_HEADS, da.HEAD_DIM, da.PAGE
SCALE = HEAD_DIM ** -0.5
BF16_BYTES = 2 * KV_HEADS * HEAD_DIM * 2
"""16-bit K+V bytes per token and layer."""
CHUNK = 65536
"""Tokens per store call (bounds the store's temporaries at 16 x 32k)."""
FORMATS = ("stock", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head",
           "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_3bit_nc", "ours")
OURS = PRESETS["2x"].settings
"""The ``2x`` preset: post-RoPE latents, one KV head per group, uniform rank."""


# ---------------------------------------------------------------------------------
# Shared problem, vLLM cache allocation, reference attention
# ---------------------------------------------------------------------------------
def paged_problem(batch, length, device, dtype, seed=0):
    """The decode step every vLLM format is timed on: ``bt`` [B, pages] int32
    (the ``B * pages`` blocks shuffled), ``slots`` [B * L] int64 (vLLM's slot of
    each token, sequence-major), ``lens`` [B] int32, ``q`` [B, HEADS, HEAD_DIM]
    in the model dtype ``dtype``."""
    g = torch.Generator(device=device).manual_seed(seed)
    per = math.ceil(length / PAGE)
    bt = torch.randperm(batch * per, device=device, generator=g).int().view(batch, per)
    pos = torch.arange(length, device=device)
    slots = (bt[:, pos // PAGE].long() * PAGE + pos % PAGE).flatten()
    lens = torch.full((batch,), length, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, generator=g).to(dtype)
    return dict(bt=bt, slots=slots, lens=lens, q=q, num_blocks=batch * per, length=length)


def store_random(store, prob, seed=1):
    """Random N(0, 1) keys and values ``[n, KV_HEADS, HEAD_DIM]`` in the model
    dtype through ``store(k, v, slots)``, :data:`CHUNK` tokens per call (the same
    values for every format)."""
    dev, dtype = prob["q"].device, prob["q"].dtype
    g = torch.Generator(device=dev).manual_seed(seed)
    total = prob["slots"].numel()
    for s in range(0, total, CHUNK):
        n = min(CHUNK, total - s)
        k = torch.randn(n, KV_HEADS, HEAD_DIM, device=dev, generator=g).to(dtype)
        v = torch.randn(n, KV_HEADS, HEAD_DIM, device=dev, generator=g).to(dtype)
        store(k, v, prob["slots"][s:s + n])


def cache_spec(kv_cache_dtype, backend, model_dtype):
    """vLLM's ``FullAttentionSpec`` of one layer (block size :data:`PAGE`) as
    ``backend.customize_spec`` publishes it (``"auto"``: ``model_dtype``)."""
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    dtype = model_dtype if kv_cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[
        kv_cache_dtype]
    spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                             dtype=dtype, kv_quant_mode=get_kv_quant_mode(kv_cache_dtype))
    return backend.customize_spec(spec)


def vllm_cache(spec, num_blocks, device):
    """One layer's cache as vLLM's worker allocates it: a zeroed int8 buffer
    viewed ``[num_blocks, heads, PAGE, C]`` in ``spec.dtype`` with the LBNHC
    (NHD) physical layout, vLLM's default and TurboQuant's only one."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    page = spec.page_size_bytes
    raw = torch.zeros(page * num_blocks, dtype=torch.int8, device=device)
    tensor = KVCacheTensor(size=raw.numel(), layers=["layers.0.attn"],
                           layer_stride=raw.numel(), block_stride=page)
    return create_kv_cache_views(raw, spec, num_blocks, KVCacheLayout.LBNHC, tensor)[0]


def gather(cache, bt_row, n):
    """Rows of the first ``n`` tokens of one sequence from ``cache``
    ``[num_blocks, PAGE, ...]`` -> ``[n, ...]``."""
    return cache[bt_row.long()].flatten(0, 1)[:n]


def attend(q, k, v, scale):
    """float32 attention of one decode token: ``q`` [HEADS, D], ``k`` / ``v``
    [n, KV_HEADS, D] -> [HEADS, D] (plain matmuls: no TF32, no fused kernel)."""
    qg = q.float().view(KV_HEADS, HEADS // KV_HEADS, -1)
    p = torch.softmax(torch.einsum("hgd,nhd->hgn", qg, k.float()) * scale, -1)
    return torch.einsum("hgn,nhd->hgd", p, v.float()).reshape(HEADS, -1)


def check_and_time(fn, reference, smoke):
    """(us, rel) of the decode call ``fn`` (returns its output) against
    ``reference()``: the median of :func:`decode_attention.time_graph`, or in
    ``smoke`` the one call's wall time under the interpreter."""
    t0 = time.perf_counter()
    out = fn().float().flatten(1)
    us = (time.perf_counter() - t0) * 1e6
    ref = reference().flatten(1)
    assert torch.isfinite(out).all(), "output not fully written"
    rel = ((out - ref).norm() / ref.norm()).item()
    if not smoke:
        us, _ = da.time_graph(fn)
    return us, rel


# ---------------------------------------------------------------------------------
# The formats: (bytes per token and layer, us, rel)
# ---------------------------------------------------------------------------------
def triton_attn_row(kv_cache_dtype, prob, smoke):
    """vLLM's TRITON_ATTN backend on a ``kv_cache_dtype`` cache (``"auto"``:
    bf16): its ``TritonAttentionImpl`` stores and decodes."""
    from vllm.utils.math_utils import largest_power_of_2_divisor, next_power_of_2
    from vllm.v1.attention.backends import triton_attn as ta
    from vllm.v1.attention.ops.int4_per_token_head import single_rht
    from vllm.v1.kv_cache_interface import KVQuantMode

    dev = prob["q"].device
    spec = cache_spec(kv_cache_dtype, ta.TritonAttentionBackend, prob["q"].dtype)
    kv_cache = vllm_cache(spec, prob["num_blocks"], dev)
    impl = ta.TritonAttentionImpl(HEADS, HEAD_DIM, SCALE, KV_HEADS, None, None, kv_cache_dtype)
    one = torch.ones((), dtype=torch.float32, device=dev)
    layer = SimpleNamespace(_q_scale=one, _k_scale=one, _v_scale=one)
    mode = impl._kv_quant_mode
    if mode == KVQuantMode.NONE:
        k_cache, v_cache = kv_cache.transpose(1, 2).split(HEAD_DIM, dim=-1)

        def store(k, v, slots):
            k_cache.flatten(0, 1)[slots] = k
            v_cache.flatten(0, 1)[slots] = v
    else:
        def store(k, v, slots):
            impl.do_kv_cache_update(layer, k, v, kv_cache, slots)
    store_random(store, prob)

    bsz, length = prob["q"].shape[0], prob["length"]
    # TritonAttentionMetadataBuilder's decode metadata: the 3D kernel up to
    # seq_threshold_3D sequences (128 // KV heads = 16, also the CUDA-graph
    # capture size nearest to it), its split-softmax scratch buffers
    thr = ta.MIN_LAUNCH_GRID_SIZE_2D // KV_HEADS
    segs = ta.NUM_PAR_SOFTMAX_SEGMENTS
    f32 = dict(dtype=torch.float32, device=dev)
    md = ta.TritonAttentionMetadata(
        num_actual_tokens=bsz, max_query_len=1,
        query_start_loc=torch.arange(bsz + 1, dtype=torch.int32, device=dev),
        max_seq_len=length, seq_lens=prob["lens"], block_table=prob["bt"],
        slot_mapping=prob["slots"].view(bsz, length)[:, -1],
        seq_threshold_3D=thr, num_par_softmax_segments=segs,
        softmax_segm_output=torch.empty(thr, HEADS, segs, next_power_of_2(HEAD_DIM), **f32),
        softmax_segm_max=torch.empty(thr, HEADS, segs, **f32),
        softmax_segm_expsum=torch.empty(thr, HEADS, segs, **f32), causal=True)
    out = torch.empty_like(prob["q"])

    def fn():
        return impl.forward(layer, prob["q"], None, None, kv_cache, md, out)

    def reference():
        if mode == KVQuantMode.NONE:
            caches = (k_cache, v_cache)
        else:
            caches = impl._pth_key_value_caches(kv_cache)
        scales = (impl._k_scale_cache, impl._v_scale_cache)
        q, scale = prob["q"].float(), SCALE
        if mode == KVQuantMode.INT4_PER_TOKEN_HEAD:  # the kernel's basis: RHT(x)
            norm = largest_power_of_2_divisor(HEAD_DIM)  # RHT(x) . RHT(y) = norm * x . y
            q, scale = single_rht(q), SCALE / norm
        outs = []
        for b, row in enumerate(prob["bt"]):
            kv = []
            for cache, sc in zip(caches, scales):
                x = gather(cache, row, length)
                if mode == KVQuantMode.NONE:
                    kv.append(x.float())
                elif mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
                    codes = torch.stack([x[..., :HEAD_DIM // 2] & 15,
                                         x[..., :HEAD_DIM // 2] >> 4], -1).flatten(-2)
                    kv.append(pc.int4_load(codes, gather(sc, row, length)))
                else:
                    kv.append(pc.per_token_head_load(x[..., :HEAD_DIM],
                                                     gather(sc, row, length)))
            outs.append(attend(q[b], *kv, scale))
        out_ref = torch.stack(outs)
        if mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
            out_ref = single_rht(out_ref, inverse=True) / norm
        return out_ref

    us, rel = check_and_time(fn, reference, smoke)
    return spec.page_size_bytes // PAGE, us, rel


def turboquant_row(kv_cache_dtype, prob, smoke):
    """vLLM's TurboQuant store and decode on a ``kv_cache_dtype`` cache, with
    the arguments ``TurboQuantAttentionImpl`` passes them."""
    from vllm.config.attention import AttentionConfig
    from vllm.triton_utils import triton
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend
    from vllm.v1.attention.ops.triton_turboquant_decode import (
        _tq_full_dequant_kv,
        _use_fp8_e4b15,
        triton_turboquant_decode_attention,
    )
    from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store

    dev = prob["q"].device
    cfg = pc.tq_config(kv_cache_dtype, HEAD_DIM)
    H, centroids, midpoints = pc.tq_tables(cfg, dev)  # layer._tq_Pi = _tq_PiT = H
    spec = cache_spec(kv_cache_dtype, TurboQuantAttentionBackend, prob["q"].dtype)
    kv_cache = vllm_cache(spec, prob["num_blocks"], dev).transpose(1, 2)  # [blk, PAGE, H, C]
    store_random(lambda k, v, slots: triton_turboquant_store(
        k, v, kv_cache, slots, H, midpoints, mse_bits=cfg.key_mse_bits,
        key_packed_size=cfg.key_packed_size, value_quant_bits=cfg.effective_value_quant_bits,
        key_fp8=cfg.key_fp8), prob)

    bsz, length = prob["q"].shape[0], prob["length"]
    splits = AttentionConfig().tq_max_kv_splits_for_cuda_graph
    mid_o = torch.empty(bsz, HEADS, splits, HEAD_DIM + 1, dtype=torch.float32, device=dev)
    out = torch.empty_like(prob["q"])
    lse = torch.empty(bsz, HEADS, dtype=torch.float32, device=dev)

    def fn():
        return triton_turboquant_decode_attention(
            query=prob["q"], kv_cache=kv_cache, block_table=prob["bt"], seq_lens=prob["lens"],
            Pi=H, centroids=centroids, scale=SCALE, mse_bits=cfg.key_mse_bits,
            key_packed_size=cfg.key_packed_size,
            value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8,
            norm_correction=cfg.norm_correction, PiT=H, mid_o_buf=mid_o, output_buf=out,
            lse_buf=lse, max_num_kv_splits=splits)

    def reference():
        # _continuation_prefill's dequant of a sequence's cache (fp16)
        alloc = math.ceil(length / PAGE) * PAGE
        k_out = torch.empty(1, KV_HEADS, alloc, HEAD_DIM, dtype=torch.float16, device=dev)
        v_out = torch.empty_like(k_out)
        q = prob["q"].float() if cfg.key_fp8 else prob["q"].float() @ H
        outs = []
        for b, row in enumerate(prob["bt"]):
            bt_b = row[None].contiguous()
            _tq_full_dequant_kv[(alloc, KV_HEADS)](
                kv_cache, bt_b, centroids, k_out, v_out, k_out.stride(0), k_out.stride(1),
                k_out.stride(2), v_out.stride(0), v_out.stride(1), v_out.stride(2),
                kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), bt_b.stride(0),
                HEAD_DIM=HEAD_DIM, BLOCK_SIZE=PAGE, NUM_KV_HEADS=KV_HEADS,
                MSE_BYTES=HEAD_DIM if cfg.key_fp8 else math.ceil(
                    HEAD_DIM * cfg.key_mse_bits / 8),
                KPS=cfg.key_packed_size, VQB=cfg.effective_value_quant_bits,
                VAL_DATA_BYTES=math.ceil(HEAD_DIM * cfg.effective_value_quant_bits / 8),
                MSE_BITS=cfg.key_mse_bits, KEY_FP8=int(cfg.key_fp8),
                BLOCK_D=triton.next_power_of_2(HEAD_DIM),
                NORM_CORRECTION=int(cfg.norm_correction),
                FP8_E4B15=_use_fp8_e4b15(dev.index or 0), num_warps=4)
            outs.append(attend(q[b], k_out[0, :, :length].transpose(0, 1),
                               v_out[0, :, :length].transpose(0, 1), SCALE))
        return torch.stack(outs)

    us, rel = check_and_time(fn, reference, smoke)
    return spec.page_size_bytes // PAGE, us, rel


def ours_row(prob, rope, smoke):
    """The ``2x`` preset's cache and decode on ``prob``'s shape:
    ``decode_attention.make_problem`` with its bits (its own latents, queries
    in the model dtype), ``run_case`` in ``post_rope`` mode (``smoke``: the same
    :class:`~vllm_lowrank.kernels.triton.decode.LatentLaunch` on CPU tensors, one
    plain call)."""
    assert OURS["method"] == "post_rope" and OURS["head_group_size"] == 1
    r = int(round(OURS["rank_fraction"] * HEAD_DIM))
    plan = da.make_plan((r,) * KV_HEADS, (r,) * KV_HEADS)
    (batch, _, _), length, device = prob["q"].shape, prob["length"], prob["q"].device
    p = da.make_problem(plan, batch, length, (OURS["k_bits"], OURS["v_bits"]), device=device)
    p["q_lat"] = p["q_lat"].to(prob["q"].dtype)

    def reference():
        return da.reference(plan, rope, p, SCALE, mode="post_rope")

    if smoke:
        out = torch.empty(batch, plan.out_width, device=device)
        launch = da.prepare_launch(plan, rope, p, mode="post_rope")

        def fn():
            launch(p["q_lat"], p["cache"], p["bt"], p["lens"], length, out=out)
            return out

        us, rel = check_and_time(fn, reference, smoke)
    else:
        us, _, rel = da.run_case(plan, rope, p, mode="post_rope", ref=reference())
    return p["layout"].slot_bytes, us, rel


def format_row(name, prob, rope, smoke):
    """(bytes per token and layer, us, rel) of one format on ``prob``'s shape."""
    if name == "ours":
        return ours_row(prob, rope, smoke)
    if name == "stock":
        return triton_attn_row("auto", prob, smoke)
    if name.endswith("_per_token_head"):
        return triton_attn_row(name, prob, smoke)
    if name.startswith("turboquant_"):
        return turboquant_row(name, prob, smoke)
    raise ValueError(f"unknown format {name!r} (known: {', '.join(FORMATS)})")


# ---------------------------------------------------------------------------------
# Table
# ---------------------------------------------------------------------------------
def free(device):
    """Return the freed tensors' memory (the next format starts from an empty GPU)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def cuda_alive():
    """False once a kernel fault has poisoned the CUDA context."""
    try:
        torch.cuda.synchronize()
        return True
    except RuntimeError:
        return False


def run(shapes, formats, smoke, json_path=None):
    """Every format on every shape: prints each row as it is measured, then the
    table; returns the rows (``json_path``: also written there)."""
    device, dtype = ("cpu", torch.float16) if smoke else ("cuda", torch.bfloat16)
    rope = da.llama3_rope(max(da.parse_shape(s)[1] for s in shapes) + 1, device)
    rows, base, lost = [], {}, None
    for shape in shapes:
        bsz, length = da.parse_shape(shape)
        base[shape] = dict(sdpa_us=None, stock_us=None)
        if not smoke:
            us, _ = da.sdpa_case(bsz, length)
            base[shape]["sdpa_us"] = us
            rows.append(dict(shape=shape, format="sdpa", bytes=BF16_BYTES, us=us, rel=None,
                             note="torch SDPA, contiguous bf16 K/V"))
            print(table_line(rows[-1], base[shape]), flush=True)
            free(device)
        prob = paged_problem(bsz, length, device, dtype)
        for name in formats:
            row = dict(shape=shape, format=name, bytes=None, us=None, rel=None, note="")
            if lost:
                row["note"] = f"not run: CUDA context lost ({lost})"
            else:
                try:
                    row["bytes"], row["us"], row["rel"] = format_row(name, prob, rope, smoke)
                except Exception as exc:  # noqa: BLE001 (reported in the row)
                    row["note"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
                    if not smoke and not cuda_alive():
                        lost = f"after {shape} {name}"
            if name == "stock":
                base[shape]["stock_us"] = row["us"]
            rows.append(row)
            print(table_line(row, base[shape]), flush=True)
            free(device)
        del prob
        free(device)
    print()
    print(TABLE_HEADER)
    for row in rows:
        row.update(base[row["shape"]])
        print(table_line(row, base[row["shape"]]))
    if json_path:
        pathlib.Path(json_path).write_text(json.dumps(rows, indent=1))
    return rows


TABLE_HEADER = ("| shape | format | B/token | vs bf16 | us | x sdpa | x stock | GB/s | "
                "rel (vs its stored K/V) | note |\n|---|---|---|---|---|---|---|---|---|---|")


def table_line(row, base):
    """One markdown row; ``base``: the shape's ``sdpa_us`` and ``stock_us``
    (``None`` where not measured)."""
    def f(x, spec):
        return "" if x is None else format(x, spec)

    us, nbytes = row["us"], row["bytes"]
    tokens = math.prod(da.parse_shape(row["shape"]))

    def speedup(ref):
        return ref / us if ref and us else None

    return (f"| {row['shape']} | {row['format']} | {f(nbytes, 'd')} | "
            f"{f(nbytes and BF16_BYTES / nbytes, '.2f')} | {f(us, '.1f')} | "
            f"{f(speedup(base['sdpa_us']), '.2f')} | {f(speedup(base['stock_us']), '.2f')} | "
            f"{f(us and nbytes and tokens * nbytes / us / 1e3, '.0f')} | "
            f"{f(row['rel'], '.1e')} | {row['note']} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=None,
                    help="BATCHxCONTEXT list (default 16x4k,1x32k,8x32k,16x32k; "
                         "--smoke: 2x64)")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help="comma list of: stock, ours, TRITON_ATTN per-token-head and "
                         "TurboQuant --kv-cache-dtype names")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check under TRITON_INTERPRET=1: tiny shapes, no CUDA graphs")
    ap.add_argument("--json", default=None, help="write every row to this file")
    args = ap.parse_args()
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs the Triton kernels in the interpreter: set "
                             "TRITON_INTERPRET=1 (before Python starts)")
        pc.use_real_triton()
        torch.set_num_threads(os.cpu_count() or 1)
        print("--smoke: CPU tensors, float16, Triton interpreter; `us` is one interpreted "
              "call (not a speed); x sdpa needs CUDA")
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (on CPU: TRITON_INTERPRET=1 ... --smoke)")
    else:
        import triton

        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"triton {triton.__version__}; device-to-device copy "
              f"{da.copy_bandwidth():.0f} GB/s (read + write)", flush=True)
    shapes = (args.shapes or ("2x64" if args.smoke else "16x4k,1x32k,8x32k,16x32k")).split(",")
    print(TABLE_HEADER, flush=True)
    run(shapes, args.formats.split(","), args.smoke, args.json)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"[{time.time() - t0:.0f} s]")
