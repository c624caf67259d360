"""One-time preparation of a decode launch (:class:`.decode.LatentLaunch`).

- :func:`prepare`: the group table (offsets, ranks, scale/zero indices and
  output columns of every head group), the RoPE-section column maps, the
  output column -> head map and the rank classes (:class:`Prepared`), cached
  per plan, layout, RoPE geometry and device (layers of one shape share them);
- :func:`pack_key_weights`: ``B_k`` of every group in the kernels'
  RoPE-section layout;
- :func:`rope_is_rotation`: whether a RoPE table composes as rotations (the
  kernels' tile-offset trick);
- :func:`sm_count`, :func:`interpreting`, :data:`TL_DTYPES`, :data:`LOG2E`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import OrderedDict

import torch
import triton.language as tl

LOG2E = 1.4426950408889634
"""``log2 e``: the kernels' scores are base 2 (``exp2``), so the softmax scale
is multiplied by it."""

TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
"""Triton element type of each cache / query dtype the kernels take."""


def interpreting() -> bool:
    """True under the Triton interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"

MAX_CLASSES = 4
"""Rank classes (padded ``(r_k, r_v)`` pairs) one grid launch serves."""


def pow2(x: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(1, x)))))


def pow2_divisor(*values: int, limit: int = 16) -> int:
    """Largest power of two up to ``limit`` that divides every one of
    ``values`` (an alignment hint for ``tl.multiple_of``: slot and block
    strides, offsets)."""
    m = limit
    while m > 1 and any(v % m for v in values):
        m //= 2
    return m


@dataclasses.dataclass
class Prepared:
    """Per (plan, layout, rope geometry, device) tables; built once."""

    group_table: torch.Tensor  # int32 [8, num_groups]: k_off v_off rk rv kpar vpar ocol cls
    maps: torch.Tensor  # int32 [7, CW] (see .decode_kernels._attend_chunk)
    head_of_col: torch.Tensor  # int32 [out_width]
    classes: tuple[tuple[int, int], ...]  # (RK_PAD, RV_PAD) per class
    group_class: tuple[int, ...]
    c1: int
    c3: int
    cw: int
    rk_max_pad: int  # largest padded key rank (RK_PAD) of the classes
    rv_max_pad: int  # largest padded value rank (RV_PAD): the wide kernel's value tile
    offsets: list  # host copy of the groups' K and V offsets (elements or bytes)


PREP_CACHE: OrderedDict = OrderedDict()
SM_COUNTS: dict = {}
CACHE_SIZE = 256
"""Entries of :data:`PREP_CACHE` (one per distinct layer shape), least recently
used evicted first."""


def cache_put(cache: OrderedDict, key, value):
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > CACHE_SIZE:
        cache.popitem(last=False)


def layout_key(layout):
    if layout is None:
        return None
    return (layout.k_ranks, layout.v_ranks, layout.k_bits, layout.v_bits,
            layout.k_groups, layout.v_groups, layout.slot_bytes)


def rank_classes(plan) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """Group the head groups into at most four ``(pad(r_k), pad(r_v))`` classes."""
    pads = [(pow2(rk), pow2(rv)) for rk, rv in zip(plan.k_ranks, plan.v_ranks)]
    classes = sorted(set(pads))
    while len(classes) > MAX_CLASSES:
        # Merge the two classes with the smallest key pads (raise to the larger).
        (a, av), (b_, bv) = classes[0], classes[1]
        merged = (max(a, b_), max(av, bv))
        classes = sorted(set([merged] + classes[2:]))
        pads = [p if p in classes else next(c for c in classes
                                             if c[0] >= p[0] and c[1] >= p[1])
                for p in pads]
    return tuple(classes), tuple(classes.index(p) for p in pads)


def prepare(plan, layout, rotary_dim: int, neox: bool, device) -> Prepared:
    key = (plan, layout_key(layout), rotary_dim, neox, str(device))
    hit = PREP_CACHE.get(key)
    if hit is not None:
        return hit
    sh = plan.shape
    d, gs, ng = sh.head_dim, plan.group_size, plan.num_groups
    hg = plan.heads_per_group
    half = rotary_dim // 2
    rest = d - rotary_dim
    c1 = pow2(gs * half)
    c3 = pow2(gs * rest) if rest else 0
    cw = max(c1, c3)
    maps = torch.full((7, cw), -1, dtype=torch.int32)
    for c in range(gs * half):
        j, p = divmod(c, half)
        maps[0, c] = p if neox else 2 * p
        maps[1, c] = p + half if neox else 2 * p + 1
        maps[3, c] = j
        maps[4, c] = j
        maps[6, c] = p
    for c in range(gs * rest):
        j, e = divmod(c, rest)
        maps[2, c] = rotary_dim + e
        maps[5, c] = j
    classes, gcls = rank_classes(plan)
    rows = [[0] * ng for _ in range(8)]
    if layout is None:
        k_offs = plan.k_offsets()
        v_offs = [plan.k_width + o for o in plan.v_offsets()]
        kpar = vpar = [0] * ng
    else:
        from vllm_lowrank.format.latent import packed_bytes

        if tuple(layout.k_ranks) != tuple(plan.k_ranks) or \
                tuple(layout.v_ranks) != tuple(plan.v_ranks):
            raise ValueError("layout ranks do not match the plan's ranks")
        k_offs, v_offs, kpar, vpar = [], [], [], []
        kb, vb, kp, vp = 0, layout.v_codes_offset, 0, 0
        for r_k, r_v, qk, qv in zip(plan.k_ranks, plan.v_ranks, layout.k_groups,
                                    layout.v_groups):
            k_offs.append(kb)
            v_offs.append(vb)
            kpar.append(kp)
            vpar.append(vp)
            kb += packed_bytes(r_k, layout.k_bits)
            vb += packed_bytes(r_v, layout.v_bits)
            kp += r_k // qk
            vp += r_v // qv
    v_out = plan.v_offsets()
    for g in range(ng):
        rows[0][g] = k_offs[g]
        rows[1][g] = v_offs[g]
        rows[2][g] = plan.k_ranks[g]
        rows[3][g] = plan.v_ranks[g]
        rows[4][g] = kpar[g]
        rows[5][g] = vpar[g]
        rows[6][g] = hg * v_out[g]
        rows[7][g] = gcls[g]
    head_of_col = torch.empty(plan.out_width, dtype=torch.int32)
    for g in range(ng):
        base = hg * v_out[g]
        for h in range(hg):
            head_of_col[base + h * plan.v_ranks[g]: base + (h + 1) * plan.v_ranks[g]] = \
                g * hg + h
    prep = Prepared(
        group_table=torch.tensor(rows, dtype=torch.int32).to(device),
        maps=maps.to(device),
        head_of_col=head_of_col.to(device),
        classes=classes,
        group_class=gcls,
        c1=c1, c3=c3, cw=cw,
        rk_max_pad=max(c[0] for c in classes),
        rv_max_pad=max(c[1] for c in classes),
        offsets=list(k_offs) + list(v_offs),
    )
    cache_put(PREP_CACHE, key, prep)
    return prep


def pack_key_weights(plan, k_up: torch.Tensor, prep: Prepared, dtype: torch.dtype
                     ) -> torch.Tensor:
    """``B_k`` of every group, columns permuted into the three RoPE sections and
    zero-padded: ``[num_groups, 3, rk_max_pad, CW]`` in ``dtype``."""
    ng, gw, d = plan.num_groups, plan.group_width, plan.shape.head_dim
    maps = prep.maps.cpu()
    out = torch.zeros(ng, 3, prep.rk_max_pad, prep.cw, dtype=torch.float32,
                      device=k_up.device)
    for g, k_off in enumerate(plan.k_offsets()):
        r = plan.k_ranks[g]
        blk = k_up[k_off:k_off + r, g * gw:(g + 1) * gw].float()
        for sec in range(3):
            src, kvh = maps[sec], maps[3 + sec]
            ok = (src >= 0).nonzero().flatten()
            if ok.numel():
                cols = (kvh[ok] * d + src[ok]).to(k_up.device)
                out[g, sec, :r, ok.to(k_up.device)] = blk[:, cols]
    return out.to(dtype).contiguous()


def rope_is_rotation(rope, block_n: int = 128) -> bool:
    """True when ``table[p0 + i] = table[p0] * table[i] / table[0]`` (as complex
    numbers per pair), i.e. the table is ``m_j * exp(1j * t * theta_j)``: the
    assumption of the fast RoPE path. The tolerance allows the float32 rounding of
    the angles ``t * theta_j`` in the table (a few ulp of ``t * theta_max``), far
    below any structural difference. One device sync per call: the decoders
    check a layer's table once, when they are prepared."""
    def check() -> bool:
        cos, sin = rope.cos.double(), rope.sin.double()
        n = cos.shape[0]
        z = torch.complex(cos, sin)
        if n < 2:
            return True
        i = torch.arange(min(block_n, n), device=cos.device)
        step = max(1, (n - i.numel()) // 64)
        p0 = torch.arange(0, n - i.numel() + 1, step, device=cos.device)
        pred = z[p0][:, None] * z[i][None] / z[0]
        actual = z[p0[:, None] + i[None]]
        mag = z.abs().amax().clamp_min(1e-30)
        err = (pred - actual).abs().amax(-1) / mag  # [P, I]
        theta_max = torch.angle(z[1] / z[0]).abs().amax()
        allowed = 1e-5 + 16 * 2.0 ** -24 * (p0[:, None] + i[None]).double() * theta_max
        return bool((err <= allowed).all()) and bool((sin[0].abs() <= 1e-6 * mag).all())

    return check()


def sm_count(device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in SM_COUNTS:
        SM_COUNTS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return SM_COUNTS[idx]
