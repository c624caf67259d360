"""Longest-processing-time-first work lists for the persistent decode kernel.

ZACK (sec. 5.3, decode): with adaptive ranks, head groups carry unequal work, so
a grid that gives every (sequence, head group) the same slot finishes when its
heaviest program does. The decode work list is

    item (b, g, s):  sequence b, head group g, context split s
    cost(b, g, s) ~  tiles(b, s) * (r_k[g] + r_v[g] + TILE_OVERHEAD) + ITEM_OVERHEAD

(tiles of ``block_n`` tokens; the rank terms are the latent bytes and the key
rebuild, linear in the rank; ``TILE_OVERHEAD`` stands for the rank-independent
per-token work: RoPE, scores and softmax, in rank units). The list is sorted
longest-first ON THE GPU (``torch.argsort``; no host sync, no Python loop per
item) and consumed by ``_decode_persistent_kernel`` on a grid of
``num_workers`` programs (a few per SM): each program takes the next item of the
sorted list from a global atomic counter when it finishes its previous one, so
the next-longest item always goes to the worker that became free first. That is
Graham's LPT list scheduling with the workers' true finishing times in place of
the model's estimates (makespan <= 4/3 of optimal for the modelled costs).

Plan once per batch, run per layer (FlashInfer's split): the items depend on
``seq_lens``, the ranks and ``num_splits``; layers that share a rank profile
share a schedule.

Example::

    sched = build_lpt_schedule(plan, seq_lens, num_splits=8, block_n=64)
    out = latent_decode_attention(plan, k_up, rope, scale, q, cache, bt, seq_lens,
                                  max_len, num_splits=8, schedule=sched)
"""

from __future__ import annotations

import dataclasses

import torch

TILE_OVERHEAD = 32
ITEM_OVERHEAD = 8


@dataclasses.dataclass(frozen=True)
class DecodeSchedule:
    """A longest-first work list.

    Attributes:
        items: int32 ``[B * num_groups * num_splits]`` item ids
            ``(b * num_groups + g) * num_splits + s``, longest first.
        costs: int64, the modelled cost of each item, in ``items`` order.
        num_splits: Splits per (sequence, group) the items were built for.
        num_workers: Persistent programs to launch.
    """

    items: torch.Tensor
    costs: torch.Tensor
    num_splits: int
    num_workers: int


def work_costs(plan, seq_lens: torch.Tensor, num_splits: int, block_n: int) -> torch.Tensor:
    """Modelled cost of every item, ``[B, num_groups, num_splits]`` int64 (on the
    device of ``seq_lens``). Splits are cut as the kernel cuts them: sequence
    ``b`` has ``ceil(seq_len / block_n)`` tiles, ``ceil(tiles / num_splits)`` per split."""
    dev = seq_lens.device
    tiles = (seq_lens.long() + block_n - 1) // block_n  # [B]
    per = (tiles + num_splits - 1) // num_splits
    s = torch.arange(num_splits, device=dev)
    n = torch.minimum(per[:, None], tiles[:, None] - s[None, :] * per[:, None]).clamp_min(0)
    w = torch.tensor([rk + rv + TILE_OVERHEAD for rk, rv in zip(plan.k_ranks, plan.v_ranks)],
                     device=dev, dtype=torch.long)
    return n[:, None, :] * w[None, :, None] + ITEM_OVERHEAD


def build_lpt_schedule(plan, seq_lens: torch.Tensor, num_splits: int, block_n: int,
                       num_workers: int | None = None, workers_per_sm: int = 2,
                       device: torch.device | None = None) -> DecodeSchedule:
    """Sort the work list longest-first on the device (see the module docstring).

    Args:
        plan: The layer plan (ranks per group).
        seq_lens: ``[B]`` int32 on the kernel's device.
        num_splits: Context splits per (sequence, group).
        block_n: The kernel's tile (tokens).
        num_workers: Persistent programs; default ``workers_per_sm`` x SM count.
    """
    device = device or seq_lens.device
    costs = work_costs(plan, seq_lens, num_splits, block_n).flatten()
    order = torch.argsort(costs, descending=True, stable=True)
    if num_workers is None:
        if device.type == "cuda":
            idx = device.index if device.index is not None else torch.cuda.current_device()
            n_sm = torch.cuda.get_device_properties(idx).multi_processor_count
        else:
            n_sm = 4
        num_workers = workers_per_sm * n_sm
    num_workers = max(1, min(int(num_workers), costs.numel()))
    return DecodeSchedule(order.to(torch.int32), costs[order], int(num_splits), num_workers)


def lpt_assign(costs, num_workers: int) -> tuple[list[int], float]:
    """Reference (host) LPT with modelled costs: the worker of each item of a
    longest-first list and the makespan. For tests and the benchmark's table."""
    import heapq

    heap = [(0.0, w) for w in range(num_workers)]
    owner = []
    for c in costs:
        load, w = heapq.heappop(heap)
        owner.append(w)
        heapq.heappush(heap, (load + float(c), w))
    return owner, max(load for load, _ in heap)


def grid_makespan(costs_grid, num_workers: int) -> float:
    """Makespan of greedy list scheduling in plain grid order (what the hardware
    block scheduler does with a non-persistent grid), modelled costs."""
    return lpt_assign(list(costs_grid), num_workers)[1]
