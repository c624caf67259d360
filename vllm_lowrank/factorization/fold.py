"""Turn per-group bases into the weights a latent attention layer runs with.

Weights are in vLLM/PyTorch ``nn.Linear`` orientation (``[out, in]``, ``y = x
W^T``). For one layer with plan ``p`` (see :mod:`.plan` for the layouts):

- ``qkv`` ``[q_size + Rk + Rv, hidden]``: ``[W_q; A_k^T; A_v^T]``, so one GEMM
  yields the query and both latents.
- ``k_up`` ``[Rk, num_kv_heads * head_dim]``: block-diagonal over head groups,
  rebuilds pre-RoPE keys ``k = c_k @ k_up`` (Palu sec. 3.1.2).
- ``o_proj`` ``[hidden, out_width]``: the value up-projection folded into the
  output projection (Palu eq. 6): for query head ``i`` reading KV head ``j``
  (local index ``jl`` in group ``g``), its columns are
  ``W_o[:, i*d:(i+1)*d] @ B_v[g][:, jl*d:(jl+1)*d]^T``, so
  ``o_proj(softmax(...) @ c_v) == o_proj_orig(softmax(...) @ (c_v @ B_v))``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from vllm_lowrank.factorization.bases import GroupBasis, factors_for_rank
from vllm_lowrank.factorization.plan import LayerPlan


@dataclasses.dataclass
class LayerFactors:
    """Low-rank factors of one layer, float32.

    Attributes:
        a_k: ``[hidden, Rk]`` key down-projection (groups concatenated).
        k_up: ``[Rk, kv_width]`` block-diagonal key up-projection.
        a_v: ``[hidden, Rv]`` value down-projection.
        v_up: ``[Rv, kv_width]`` block-diagonal value up-projection.
    """

    a_k: torch.Tensor
    k_up: torch.Tensor
    a_v: torch.Tensor
    v_up: torch.Tensor


def layer_factors(
    plan: LayerPlan,
    k_bases: Sequence[GroupBasis],
    v_bases: Sequence[GroupBasis],
    w_k: torch.Tensor,
    w_v: torch.Tensor,
) -> LayerFactors:
    """Truncate each group's basis to the plan's rank and concatenate.

    Args:
        plan: The layer plan.
        k_bases, v_bases: One basis per head group.
        w_k, w_v: ``[kv_width, hidden]`` original k_proj / v_proj weights
            (``nn.Linear`` orientation), for full-rank groups.

    Raises:
        ValueError: wrong number of bases or a rank the basis cannot give.
    """
    if len(k_bases) != plan.num_groups or len(v_bases) != plan.num_groups:
        raise ValueError(
            f"need {plan.num_groups} key and value bases, got {len(k_bases)}, "
            f"{len(v_bases)}"
        )
    a_k, k_up = _side(plan, k_bases, plan.k_ranks, w_k)
    a_v, v_up = _side(plan, v_bases, plan.v_ranks, w_v)
    return LayerFactors(a_k=a_k, k_up=k_up, a_v=a_v, v_up=v_up)


def group_projection(plan: LayerPlan, w: torch.Tensor, group: int) -> torch.Tensor:
    """``[hidden, group_width]`` float32 projection of one head group from an
    ``nn.Linear`` weight ``w`` (``[kv_width, hidden]``)."""
    gw = plan.group_width
    return w[group * gw : (group + 1) * gw].float().T


def _side(plan: LayerPlan, bases: Sequence[GroupBasis], ranks: Sequence[int],
          w: torch.Tensor):
    gw = plan.group_width
    a_parts = []
    up = torch.zeros(sum(ranks), plan.shape.kv_width, dtype=torch.float32)
    row = 0
    for g, (basis, r) in enumerate(zip(bases, ranks)):
        a, b = factors_for_rank(basis, r, group_projection(plan, w, g))
        a_parts.append(a)
        up[row : row + r, g * gw : (g + 1) * gw] = b
        row += r
    return torch.cat(a_parts, dim=1), up


def rotate_latents(plan: LayerPlan, f: LayerFactors, sides: str, seed: int) -> LayerFactors:
    """Fold a randomised Hadamard rotation ``R`` into each group's latent
    (Palu eq. 8): ``A' = A R``, ``B' = R^T B``, so ``A' B' = A B`` exactly and the
    cached latent ``x A'`` has its energy spread over all channels (fewer
    per-token outliers to quantize).

    Args:
        plan: The layer plan.
        f: Factors to rotate.
        sides: ``"k"``, ``"v"`` or ``"kv"``: which latents to rotate.
        seed: Base seed (each layer/side/group gets its own rotation).
    """
    from vllm_lowrank.format.latent import latent_rotation

    out = LayerFactors(f.a_k.clone(), f.k_up.clone(), f.a_v.clone(), f.v_up.clone())
    for side, a, up, ranks, offsets in (("k", out.a_k, out.k_up, plan.k_ranks, plan.k_offsets()),
                                        ("v", out.a_v, out.v_up, plan.v_ranks, plan.v_offsets())):
        if side not in sides:
            continue
        for g, (off, r) in enumerate(zip(offsets, ranks)):
            rot = latent_rotation(r, seed, g, side)
            a[:, off:off + r] = a[:, off:off + r] @ rot
            up[off:off + r] = rot.T @ up[off:off + r]
    return out


def folded_o_proj(plan: LayerPlan, w_o: torch.Tensor, v_up: torch.Tensor) -> torch.Tensor:
    """``[hidden, out_width]`` o_proj with the value up-projection folded in.

    Args:
        plan: The layer plan.
        w_o: ``[hidden, num_heads * head_dim]`` original o_proj weight.
        v_up: ``[Rv, kv_width]`` block-diagonal value up-projection.
    """
    d = plan.shape.head_dim
    qpk = plan.shape.queries_per_kv
    w = w_o.double()
    v_up = v_up.double()
    cols = []
    v_off = plan.v_offsets()
    for i in range(plan.shape.num_heads):
        j = i // qpk
        g = j // plan.group_size
        r = plan.v_ranks[g]
        b = v_up[v_off[g] : v_off[g] + r, j * d : (j + 1) * d]  # [r, d]
        cols.append(w[:, i * d : (i + 1) * d] @ b.T)  # [hidden, r]
    return torch.cat(cols, dim=1).to(w_o.dtype)


def value_bias_through_o_proj(
    plan: LayerPlan, w_o: torch.Tensor, b_v: torch.Tensor
) -> torch.Tensor:
    """``o_proj`` contribution of a value bias: rows of ``softmax`` sum to one,
    so ``softmax(.) @ (V + b_v) = softmax(.) @ V + b_v`` and the bias becomes a
    constant ``[hidden]`` added after o_proj.

    Args:
        plan: The layer plan.
        w_o: ``[hidden, num_heads * head_dim]`` original o_proj weight.
        b_v: ``[num_kv_heads * head_dim]`` value bias.

    Returns:
        ``[hidden]`` float32.
    """
    per_kv = b_v.float().view(plan.shape.num_kv_heads, plan.shape.head_dim)
    per_q = per_kv.repeat_interleave(plan.shape.queries_per_kv, dim=0)
    return w_o.float() @ per_q.reshape(-1)
