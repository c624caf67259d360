"""Decode attention of one layer against its roofline: bytes read, time, share of
the HBM bandwidth, and stock bf16 attention on the same batch.

For each setting and batch shape (Llama-3-8B attention: 32 query and 8 KV heads
of 128, bf16 queries) the script builds a random paged cache in the setting's
format (random codes, valid float16 scales), checks the kernel against the
torch path on a small batch (relative L2 error), then times one decode call
with CUDA events (``triton.testing.do_bench``, median) and prints:

- ``bytes``: what the call must read at least: every cached token's slot of
  the latent cache (codes and scales: ``slot_bytes``), the exact tokens' slots
  for token-adaptive settings, the queries and the output;
- ``us``, ``GB/s`` and ``% peak``: bytes over time against the device copy
  bandwidth measured in the same run (a device-to-device copy of 2 GiB,
  read + write);
- ``x sdpa``: stock attention's time (``scaled_dot_product_attention`` with GQA
  over dense bf16 keys and values of the same batch, the bandwidth-bound
  reference) over the setting's.

Settings (``--settings``): ``prk-0.5`` (post-RoPE 4-bit keys per channel over
32 tokens, value latents of rank 64 per KV head at 4 bits, 32 sink + 128
recent exact int8 tokens: :mod:`vllm_lowrank.kernels.triton.decode_post_rope`),
``prk-0.5-k2`` (the same with 2-bit keys), ``prk-0.75`` (value rank 96 of 128),
``prk-0.5-v8`` (8-bit values), ``prk-v2`` / ``prk-v4`` (2- / 4-bit values at full rank),
``prk-v2-0.5`` (2-bit values of rank 64),
``pr-k4v4`` (post-RoPE keys and values, 4 bits per token, per KV head: the
packed kernel of :mod:`vllm_lowrank.kernels.triton.decode_packed`), ``prk-4x`` (the
``4x`` preset's layout: keys per channel over 64 tokens, 2-bit values at full rank,
64 sink + 128 recent int8 tokens, blocks of 64). A ``-cuda`` suffix on a
post-RoPE-keys setting (``prk-4x-cuda``, ``prk-v4-cuda``, ``prk-0.5-cuda``, ...) times the
CUDA decoder (:class:`vllm_lowrank.attention.decoders.PostRopeKeysCudaDecoder`,
``vllm_lowrank/kernels/cuda/post_rope_decode.cu``) on the same layout instead of
the Triton kernel, through the decoder object the plugin serves (its own split
count and its reduce).

    source .gpuvllm/env.sh && python3 -P benchmarks/decode_roofline.py \\
        --shapes 1x4096,16x4096,16x32768,128x2048
    source .gpuvllm/env.sh && python3 -P benchmarks/decode_roofline.py \\
        --settings prk-4x,prk-4x-cuda,prk-v4,prk-v4-cuda --shapes 16x32768,128x2048
    source .gpuvllm/env.sh && python3 -P benchmarks/decode_roofline.py \\
        --settings prk-4x --shapes 128x32768 --kv-heads 1   # 16 x 32k's bytes, 1-head slots

A CTA of the post-RoPE-keys kernels reads one KV head's share of every slot (about
110 of the ``4x`` layout's 864 bytes per token at 8 KV heads, and the 16-byte chunk of
value scales that all heads share); ``--kv-heads 1`` reads whole slots, so the pair
tells what that striding costs. The CUDA decoder refuses 1-head slots (their
regions are not 16-byte aligned), so the pair is the Triton kernel's.
"""

from __future__ import annotations

import argparse
import math

import torch

KV_HEADS, QUERIES_PER_KV_HEAD, HEAD_DIM = 8, 4, 128
BLOCK = 32

SETTINGS = {
    # name: (kind, k_bits, v_bits, value rank per KV head, exact bits[, key group
    # tokens, block size, sink]; default 32, BLOCK, 32)
    "prk-4x": ("post_rope_keys", 4, 2, 128, 8, 64, 64, 64),
    "prk-0.5": ("post_rope_keys", 4, 4, 64, 8),
    "prk-0.5-k2": ("post_rope_keys", 2, 4, 64, 8),
    "prk-0.75": ("post_rope_keys", 4, 4, 96, 8),
    "prk-0.5-v8": ("post_rope_keys", 4, 8, 64, 8),
    "prk-v2": ("post_rope_keys", 4, 2, 128, 8),
    "prk-v2-0.5": ("post_rope_keys", 4, 2, 64, 8),
    "prk-v4": ("post_rope_keys", 4, 4, 128, 8),
    "pr-k4v4": ("packed", 4, 4, 128, None),
}


def parse_shape(s: str) -> tuple[int, int]:
    b, n = s.lower().split("x")
    return int(b), int(n)


def copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth, bytes/s (read + write of 2 GiB)."""
    import triton

    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300,
                                 return_mode="median")
    return 2 * x.numel() / (ms * 1e-3)


def setting(name: str) -> tuple:
    """``(kind, k_bits, v_bits, rank, exact bits, key group, block, sink, cuda)`` of a
    setting name (``-cuda``: the CUDA decoder on the base setting's layout)."""
    cuda = name.endswith("-cuda")
    base = name[:-len("-cuda")] if cuda else name
    kind, kb, vb, rv, ebits, *rest = SETTINGS[base]
    kct, block, sink = rest or (32, BLOCK, 32)
    if cuda and kind != "post_rope_keys":
        raise SystemExit(f"{name}: only post-RoPE-keys settings have a CUDA decoder")
    return kind, kb, vb, rv, ebits, kct, block, sink, cuda


def random_paged(bsz: int, length: int, slot_bytes: int, device, g, block: int = BLOCK) -> tuple:
    """A uint8 paged cache of random bytes for ``bsz`` sequences of ``length``
    tokens on shuffled blocks of ``block`` tokens, and its block table and lengths."""
    per = math.ceil(length / block)
    nblk = bsz * per + 1
    cache = torch.randint(0, 256, (nblk, 1, block, slot_bytes), dtype=torch.uint8,
                          device=device, generator=g)
    table = (torch.randperm(nblk - 1, device=device, generator=g)[:bsz * per] + 1) \
        .view(bsz, per).to(torch.int32)
    lens = torch.full((bsz,), length, dtype=torch.int32, device=device)
    return cache, table, lens


def fill_f16(cache: torch.Tensor, start: int, stop: int, g) -> None:
    """Overwrite bytes ``[start, stop)`` of every slot with float16 values in
    [0.01, 0.1) (valid scales and zeros instead of random bit patterns)."""
    if stop <= start:
        return
    n = (stop - start) // 2
    vals = (torch.rand(*cache.shape[:3], n, device=cache.device, generator=g) * 0.09 + 0.01)
    cache[..., start:start + 2 * n] = vals.to(torch.float16).view(torch.uint8)


def build(name: str, bsz: int, length: int, device, g, kv_heads: int = KV_HEADS):
    """``(call, bytes, reference)`` of a setting with ``kv_heads`` KV heads (4 query
    heads each): ``call()`` runs the decode, ``reference()`` returns ``(kernel output,
    torch-path output)`` on the same inputs (small batches only)."""
    from vllm_lowrank.attention import token_adaptive as tale
    from vllm_lowrank.attention.latent_attention import decode_attention
    from vllm_lowrank.factorization.plan import AttentionShape, LayerPlan
    from vllm_lowrank.format.exact import ExactSlot
    from vllm_lowrank.format.latent import SlotLayout

    kind, kb, vb, rv, ebits, kct, block, sink, cuda = setting(name)
    heads = QUERIES_PER_KV_HEAD * kv_heads
    shape = AttentionShape(heads * HEAD_DIM, heads, kv_heads, HEAD_DIM)
    q = torch.randn(bsz, heads, HEAD_DIM, device=device, generator=g).to(torch.bfloat16)
    out = torch.empty(bsz, heads * HEAD_DIM, device=device, dtype=torch.bfloat16)
    scale = HEAD_DIM ** -0.5
    if kind == "post_rope_keys":
        from vllm_lowrank.kernels.triton.decode_post_rope import PostRopeLaunch

        plan = LayerPlan(shape, 1, (HEAD_DIM,) * kv_heads, (rv,) * kv_heads)
        layout = SlotLayout(plan.k_ranks, plan.v_ranks, kb, vb, k_channel_tokens=kct)
        slot = ExactSlot(shape.kv_width, HEAD_DIM, torch.bfloat16, ebits, 0, layout.slot_bytes)
        cache, table, lens = random_paged(bsz, length, layout.slot_bytes, device, g, block)
        fill_f16(cache, layout.k_scale_offset, layout.natural_bytes, g)
        exact = torch.randint(0, 256, (cache.shape[0], 1, block, slot.slot_bytes),
                              dtype=torch.uint8, device=device, generator=g)
        lay8 = slot.int8_layout
        fill_f16(exact, lay8.k_scale_offset, lay8.natural_bytes, g)
        v_up = torch.zeros(plan.v_width, shape.kv_width, device=device)
        for j in range(kv_heads):
            v_up[j * rv:(j + 1) * rv, j * HEAD_DIM:(j + 1) * HEAD_DIM] = \
                torch.randn(rv, HEAD_DIM, device=device, generator=g) / rv ** 0.5
        n_exact = min(length, sink + 129)
        nbytes = bsz * ((length - n_exact) * layout.slot_bytes + n_exact * slot.kv_bytes)
        if cuda:
            import types

            from vllm_lowrank.attention.decoders import (DecodeBatch, DecoderContext,
                                                         PostRopeKeysCudaDecoder)

            layer = types.SimpleNamespace(
                plan=plan, layout=layout, v_up=v_up, post_rope=True,
                exact=types.SimpleNamespace(sink=sink, recent=128, slot=slot),
                impl=types.SimpleNamespace(scale=scale))
            ctx = DecoderContext(torch.bfloat16, device, block, None, length)
            why = PostRopeKeysCudaDecoder.supports(layer, ctx)
            if why is not None:
                raise SystemExit(f"{name}: the CUDA decoder refuses this layout: {why}")
            decoder = PostRopeKeysCudaDecoder(layer, ctx)
            batch = DecodeBatch(table, lens, length, length, exact_cache=exact,
                                exact_block_table=table)
            geometry = decoder.plan(batch)

            def call():
                decoder.run(q, cache, batch, geometry, out)
        else:
            launch = PostRopeLaunch(plan, layout, slot, v_up, scale=scale, sink=sink,
                                    recent=128, dtype=torch.bfloat16, block_size=block)
            splits = launch.num_splits(bsz, length, device)

            def call():
                launch(q, cache, table, exact, table, lens, splits, out)

        def reference():
            call()
            want = tale.decode(plan, torch.empty(0, shape.kv_width, device=device), v_up, None,
                               scale, q.float(), cache, table, exact, table, lens, length,
                               sink=sink, recent=128, exact=slot, layout=layout,
                               mode="post_rope")
            return out.float(), want
    else:
        from vllm_lowrank.kernels.triton.decode import LatentLaunch

        plan = LayerPlan(shape, 1, (HEAD_DIM,) * kv_heads, (HEAD_DIM,) * kv_heads)
        layout = SlotLayout(plan.k_ranks, plan.v_ranks, kb, vb)
        cache, table, lens = random_paged(bsz, length, layout.slot_bytes, device, g)
        fill_f16(cache, layout.k_scale_offset, layout.natural_bytes, g)
        launch = LatentLaunch(plan, layout, mode="post_rope", scale=scale, dtype=torch.bfloat16,
                              device=device, block_size=BLOCK)
        assert launch.kernel == "packed", launch.kernel
        splits = launch.geometry(bsz, length)[0]
        nbytes = bsz * length * layout.slot_bytes
        res = {}

        def call():
            res["out"] = launch(q, cache, table, lens, length, num_splits=splits)

        def reference():
            call()
            want = decode_attention(plan, None, None, scale, q.float(), cache, table, lens,
                                    length, post_rope=True, layout=layout)
            return res["out"], want
    nbytes += 2 * q.numel() * 2
    return call, nbytes, reference


def sdpa_call(bsz: int, length: int, device, g, kv_heads: int = KV_HEADS):
    """Stock attention on the same batch: dense bf16 keys and values, GQA."""
    import torch.nn.functional as F

    q = torch.randn(bsz, QUERIES_PER_KV_HEAD * kv_heads, 1, HEAD_DIM, device=device, generator=g,
                    dtype=torch.bfloat16)
    k = torch.randn(bsz, kv_heads, length, HEAD_DIM, device=device, generator=g,
                    dtype=torch.bfloat16)
    v = torch.randn_like(k)
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def main() -> None:
    import triton

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--shapes", default="1x4096,16x4096,16x32768,128x2048")
    p.add_argument("--kv-heads", type=int, default=KV_HEADS,
                   help="KV heads per layer (4 query heads each; Llama-3-8B: 8). Fewer heads "
                        "at a larger batch read the same bytes from narrower slots")
    p.add_argument("--check-only", action="store_true",
                   help="only the correctness check (runs on a CPU under TRITON_INTERPRET=1)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=device).manual_seed(0)
    for name in args.settings.split(","):
        call, _, reference = build(name, 2, 300 if args.check_only else 1000, device, g,
                                   args.kv_heads)
        got, want = reference()
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        print(f"{name}: relative error vs the torch path: {err:.2e}", flush=True)
    if args.check_only:
        return
    peak = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}: device copy {peak / 1e12:.2f} TB/s, "
          f"triton {triton.__version__}")
    rows = ["| setting | shape | bytes (MB) | us | GB/s | % peak | sdpa us | x sdpa |",
            "|---|---|---|---|---|---|---|---|"]
    for shape_s in args.shapes.split(","):
        bsz, length = parse_shape(shape_s)
        ref = sdpa_call(bsz, length, device, g, args.kv_heads)
        t_ref = triton.testing.do_bench(ref, warmup=25, rep=200, return_mode="median") * 1e3
        torch.cuda.empty_cache()
        for name in args.settings.split(","):
            call, nbytes, _ = build(name, bsz, length, device, g, args.kv_heads)
            t = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median") * 1e3
            gbs = nbytes / t / 1e3
            rows.append(f"| {name} | {shape_s} | {nbytes / 1e6:.1f} | {t:.1f} | {gbs:.0f} | "
                        f"{100 * gbs * 1e9 / peak:.1f} | {t_ref:.1f} | {t_ref / t:.2f} |")
            print(rows[-1], flush=True)
            del call
            torch.cuda.empty_cache()
    print("\n".join(rows))


if __name__ == "__main__":
    main()
