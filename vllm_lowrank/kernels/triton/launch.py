"""Launch parameters of the decode kernels: the per-case defaults, the wave
model of the context split, and when a head group needs the wide-group kernel.

Chosen on the host once per call (cached where they depend only on the plan):
:class:`vllm_lowrank.kernels.triton.decode.LatentLaunch` reads
them; :class:`KernelConfig` overrides them (benchmarks, sweeps).
"""

from __future__ import annotations

import dataclasses
import functools

import triton

from .decode_prep import Prepared, pow2, prepare


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the decode kernel (``None``: the built-in heuristic)."""

    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    transposed: bool | None = None  # S^T = K' q'^T (True) or S = q' K'^T (False)
    programs_per_sm: int | None = None  # resident programs per SM (split model)
    groups_per_program: int | None = None  # head groups sharing one score tile (1, 2, 4)
    wide: bool | None = None  # one program per KV head, rank in chunks (.decode_wide)
    rank_chunk: int | None = None  # wide kernel: key latent channels per chunk
    value_chunk: int | None = None  # latent_rope kernel: value channels per program
    heads_per_program: int | None = None  # wide kernel: KV heads per program (gcd with G)
    chunk_outer: bool | None = None  # wide kernel: rank-chunk loop outside the KV-head loop
    packed: bool | None = None  # post-RoPE per-token packed kernel (.decode_packed)


TRITON_MAX_KEY_TILE = 128 * 128
"""Largest ``pad(r_k) x pad(G * rotary_dim / 2)`` key up-projection section the
Triton kernel holds per program (larger groups take :mod:`.decode_wide`): measured on an H100 (Llama-3-8B shape, ratio
0.5), head groups of 2 KV heads (rank 128, 128 x 128) compile, groups of 4
(rank 256, 256 x 256) ask for 289,792 bytes of shared memory (limit 232,448),
groups of 8 for 1,134,592."""


def needs_wide(plan, layout, rotary_dim: int) -> bool:
    """Whether a head group's key up-projection tile exceeds
    :data:`TRITON_MAX_KEY_TILE`, so that pre-RoPE decode splits each group across
    programs (:mod:`.decode_wide`). Checked without compiling."""
    return _key_tile_too_large(prepare(plan, layout, rotary_dim, True, "cpu"))


def _key_tile_too_large(prep: Prepared) -> bool:
    return prep.rk_max_pad * prep.cw > TRITON_MAX_KEY_TILE


def _gpp_ok(plan, prep, gpp: int) -> bool:
    return (len(prep.classes) == 1 and plan.num_groups % gpp == 0
            and all(r == prep.classes[0][0] for r in plan.k_ranks)
            and all(r == prep.classes[0][1] for r in plan.v_ranks))


def _default_gpp(plan, prep, hg: int) -> int:
    """Largest of 4, 2, 1 that keeps the score tile at 16 query heads or fewer."""
    for gpp in (4, 2):
        if gpp * hg <= 16 and _gpp_ok(plan, prep, gpp):
            return gpp
    return 1


SPLIT_OVERHEAD_TILES = 4
"""Per-program fixed cost (prologue: B_k, cos/sin, q; epilogue: partial store), in
tiles; measured on an H200 (benchmarks/decode_attention_notes.md in git history)."""


@functools.lru_cache(maxsize=4096)
def choose_num_splits(batch: int, num_groups: int, max_seq_len: int, block_n: int,
                      n_sm: int, programs_per_sm: int = 1, max_splits: int = 64) -> int:
    """Context splits per (sequence, group) minimising a wave model of the launch:

        time ~ ceil(B * groups * S / (n_sm * programs_per_sm)) * (ceil(tiles / S) + c0)

    (``c0`` = :data:`SPLIT_OVERHEAD_TILES`): more splits fill the SMs and shorten
    the last wave, each split adds a fixed cost. Ties go to fewer splits (no
    reduce pass at S = 1)."""
    work = batch * num_groups
    tiles = triton.cdiv(max(1, max_seq_len), block_n)
    slots = max(1, n_sm * programs_per_sm)
    best, best_cost = 1, None
    for s in range(1, min(max_splits, tiles) + 1):
        cost = triton.cdiv(work * s, slots) * (triton.cdiv(tiles, s) + SPLIT_OVERHEAD_TILES)
        cost += 0 if s == 1 else 1  # the reduce pass
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


PACKED_G1_CONFIGS = {
    ("pre_rope", ((64, 64),)): (128, 4, 2),
    ("pre_rope", ((128, 128),)): (32, 4, 3),
}
"""``(BLOCK_N, warps, stages)`` (not transposed, one group per program) of the
grid kernel for packed per-token caches with one KV head per group and one rank
class, by ``(mode, rank classes)``: the fastest correct variant of the H100
sweep (``benchmarks/decode_attention.py --quant-sweep``, 24 variants, triton
3.6, benchmarks/README.md's history in git, "Launch parameters on packed caches"), 1.11-1.20x the
earlier defaults at 16 x 4k and 1 x 32k. (Post-RoPE K8/V4, swept too, now
decodes on :mod:`.decode_packed`.)"""


def _default_config(plan, prep: Prepared, mode: str, device, quant: bool) -> dict:
    """Launch parameters per case, measured on an H200 with triton 3.6
    (benchmarks/decode_attention_notes.md, in git history, has the sweep). Only variants that were
    checked correct on that compiler are chosen: triton 3.6 miscompiles several
    transposed bf16 variants (BLOCK_N=64 with 4 warps; 2 or 4 groups per
    program; the rank-128 class at BLOCK_N >= 64); tests/kernels/test_gpu_kernels.py
    guards the defaults at serving shapes."""
    hg = plan.heads_per_group
    if device.type != "cuda":  # interpreter: small tiles, every code path
        return dict(block_n=16, num_warps=4, num_stages=1, transposed=True,
                    programs_per_sm=1, groups_per_program=_default_gpp(plan, prep, hg))
    packed = PACKED_G1_CONFIGS.get((mode, prep.classes)) \
        if quant and plan.group_size == 1 else None
    if packed is not None:
        block_n, num_warps, num_stages = packed
        return dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                    transposed=False, programs_per_sm=2, groups_per_program=1)
    stages = 2 if quant else 3
    pair_ok = 2 * hg <= 16 and _gpp_ok(plan, prep, 2)
    if pair_ok and prep.rk_max_pad <= 64 and prep.rv_max_pad <= 64:
        # Two head groups share one score tile (8 real query heads of 16).
        if mode == "pre_rope":
            return dict(block_n=64, num_warps=4, num_stages=stages, transposed=False,
                        programs_per_sm=2, groups_per_program=2)
        return dict(block_n=128, num_warps=4, num_stages=2, transposed=False,
                    programs_per_sm=2, groups_per_program=2)
    if len(prep.classes) == 1 and prep.rk_max_pad <= 64 and prep.c1 <= 64:
        return dict(block_n=128, num_warps=8, num_stages=stages, transposed=True,
                    programs_per_sm=2, groups_per_program=1)
    # Uneven ranks (several rank classes in one launch), rank 128, wide groups.
    block_n = 32
    while block_n > 16 and (2 * prep.c1 + prep.c3) * block_n > 256 * 32:
        block_n //= 2
    return dict(block_n=block_n, num_warps=4, num_stages=2, transposed=True,
                programs_per_sm=2, groups_per_program=1)


PACKED_CONFIG = (64, 2, 3, 4)
"""``(BLOCK_N, warps, stages, programs per SM)`` of the packed post-RoPE kernel
(:mod:`.decode_packed`) on a GPU: small programs, many of them resident per SM,
each with its own softmax state, and the context split by the wave model at 4
programs per SM. H200 sweep (``(BLOCK_N, warps, stages)`` in {32, 64, 128} x {1,
2, 4, 8} x {2, 3, 4}, 2-16 programs per SM in the split model; benchmarks/README.md,
"Small programs for the packed kernel"): 1.43x / 1.30x / 1.08x the earlier
``(128, 8, 2)`` at 2 programs per SM, at 8 x 32k / 16 x 4k / 1 x 32k. 3 stages
since the slot pointers are carried from tile to tile (2 were best before):
210.8 / 65.9 / 49.2 us against 215.2 / 68.3 / 50.1 us, H200, two runs."""


def _packed_config(device) -> dict:
    """Launch parameters of the packed post-RoPE kernel (:mod:`.decode_packed`):
    :data:`PACKED_CONFIG` on a GPU, 16-token tiles under the interpreter."""
    block_n, num_warps, num_stages, per_sm = PACKED_CONFIG if device.type == "cuda" \
        else (16, 4, 1, 2)
    return dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                transposed=False, programs_per_sm=per_sm)


def _latent_rope_config(prep: Prepared, device) -> dict:
    """Launch parameters of the RoPE-equivariant latent kernel
    (:mod:`.decode_latent_rope`): one program per head group and split with
    all value channels (an H200 sweep of the kernel's first version put one
    value program ahead of 2-8: each scores the whole key latent), 8 warps (the
    ``32 x 512`` float32 value accumulator spills at 4: ``kernel_resources.py``),
    32-token tiles (per-channel keys: one token group); 16-token tiles under
    the interpreter (several value programs). The split model counts one
    program per SM: at 255 registers and 8 warps no second one is resident
    (``ncu``: 12.5 % occupancy), and counting two split the context into twice
    the programs, run in two waves (H200, ``8x rope_equivariant``: 209.5 against 229.6 us at
    16 x 4k, 759.4 against 778.4 us at 128 x 2k; benchmarks/README.md's history in git, "The
    exact part of token-adaptive decode")."""
    if device.type != "cuda":
        return dict(block_n=16, num_warps=4, num_stages=1, transposed=False,
                    programs_per_sm=1, value_chunk=16)
    return dict(block_n=32, num_warps=8, num_stages=2, transposed=False,
                programs_per_sm=1, value_chunk=prep.rv_max_pad)


WIDE_GROUP_MIN_PROGRAMS = 4
"""Fewest ``B x num_groups`` per split for which the wide kernel runs several KV
heads per program (:func:`wide_heads_per_program`) instead of one. H100,
Llama-3-8B shape, per-channel 4-bit keys, 4-bit values (``benchmarks/
decode_attention.py --settings recommended --settings-sweep``): at 16 x 32k one
program per head group was 1.40x (``4x`` preset, value rank 512) and 2.10x (the
``8x`` allocation) faster than one per KV head; at 1 x 32k 0.81x / 1.03x (one
sequence leaves a program a few tiles per split: its prologue, the query of all
its heads, no longer pays off)."""

WIDE_MAX_QUERY_ROWS = 16
"""Query rows of one wide-kernel program with several KV heads: one 16-row MMA
tile. H100 sweep (same command, 2026-11-26), J-LRD on 8 KV heads of 4 query
heads, rank chunk loop outside the KV-head loop: 4 KV heads per program (16
rows) took the ``4x`` layer from 12,156 to 7,636 us at 16 x 32k and from 6,022
to 3,839 us at 64 x 4k, the ``8x`` allocation's from 6,976 to 5,343 / 3,695 to
2,654 us; the whole group (32 rows) 10,877 / 5,428 and 7,866 / 3,878; 2 KV heads
(8 rows) 11,005 / 5,506 and 8,524 / 4,132."""


def wide_heads_per_program(bsz: int, num_groups: int, group_size: int, queries_per_kv: int,
                           rv_pad: int) -> int:
    """KV heads per program of the wide kernel (``HPP`` of
    :func:`.decode_wide.wide_decode_kernel`): 1 with fewer than
    :data:`WIDE_GROUP_MIN_PROGRAMS` sequences x head groups, else the largest
    divisor of the group size whose query heads fit :data:`WIDE_MAX_QUERY_ROWS`
    rows, when the value accumulator ``[pow2(rows), rv_pad]`` (the kernel's
    ``HG_PAD``: at least 16 rows) stays within 16 K float32 (larger ones spill)."""
    if bsz * num_groups < WIDE_GROUP_MIN_PROGRAMS:
        return 1
    hpp = max([d for d in range(1, group_size + 1)
               if group_size % d == 0 and d * queries_per_kv <= WIDE_MAX_QUERY_ROWS],
              default=1)
    return hpp if pow2(hpp * queries_per_kv) * rv_pad <= 16 * 1024 else 1


def _wide_config(plan, prep: Prepared, device) -> dict:
    """Launch parameters of the wide-group kernel (:mod:`.decode_wide`): value
    tiles of ``BLOCK_N x pad(r_v)`` up to 16 K elements, rank chunks of 64 (a
    power-of-two per-channel-group size above 64 sets the chunk; any other
    group size, one chunk of the padded rank). On an H100 at G = 8, rank 512
    the launch sweep put ``BLOCK_N`` 32, 4 warps, chunk 64 first (1.2-1.3x the
    ``BLOCK_N`` 64 launch; benchmarks/README.md, "GPU serving inside vLLM")."""
    rv_pad = prep.rv_max_pad
    if device.type != "cuda":  # interpreter: small tiles, several rank chunks
        return dict(block_n=16, num_warps=4, num_stages=1, transposed=False,
                    programs_per_sm=1, rank_chunk=16)
    block_n = 64
    while block_n > 16 and block_n * rv_pad > 16 * 1024:
        block_n //= 2
    return dict(block_n=block_n, num_warps=4, num_stages=2, transposed=False,
                programs_per_sm=2, rank_chunk=64)
