"""Base (non-LoRA) MoE align on the device: pairs bucketed by local expert, buckets padded to the block size.

Vectorised torch ops with no host loop over experts and no device->host sync (CUDA-graph capturable):
a stable sort of the pairs by local expert (ascending flat-pair order inside a bucket), per-expert
counts by scatter-add, padded exclusive prefix sums, block -> expert by searchsorted. The two steps
are public so the OAI-style grouped GEMM builds its block table from the same code.
"""
from __future__ import annotations

import torch


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_topk_ids(topk_ids, arg: str = "topk_ids") -> torch.Tensor:
    """topk_ids must be a 2-D (T, k) int32 tensor with k >= 1."""
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"{arg} must be an int32 torch.Tensor of shape (T, k); got {type(topk_ids).__name__}")
    if topk_ids.dtype != torch.int32:
        raise TypeError(f"{arg} must be int32 (T, k); got dtype {topk_ids.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[1] < 1:
        raise ValueError(f"{arg} must have shape (T, k) with k >= 1; got {tuple(topk_ids.shape)}")
    return topk_ids


def check_expert_map(expert_map, device: torch.device) -> torch.Tensor | None:
    """expert_map (global -> local id, -1 = not on this rank) must be a 1-D int32 tensor on `device`."""
    if expert_map is None:
        return None
    if not isinstance(expert_map, torch.Tensor):
        raise TypeError(f"expert_map must be an int32 torch.Tensor (num_global_experts,); got {type(expert_map).__name__}")
    if expert_map.dtype != torch.int32 or expert_map.dim() != 1 or expert_map.numel() == 0:
        raise ValueError(
            f"expert_map must be a non-empty 1-D int32 tensor (num_global_experts,); got dtype {expert_map.dtype}, "
            f"shape {tuple(expert_map.shape)}"
        )
    if expert_map.device != device:
        raise ValueError(f"expert_map is on {expert_map.device}; it must be on topk_ids' device {device}")
    return expert_map


def _pos_int(v, arg: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{arg} must be a positive int; got {v!r}")
    return v


def sort_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int, expert_map=None):
    """Pairs p = t*k + j grouped by LOCAL expert: (order int64 (T*k,), seg_offsets int32 (E+1,)).

    order[:seg_offsets[E]] lists the local pairs, expert 0's first, ascending p inside an expert;
    the rest of `order` holds the dropped pairs (id -1 or out of range, or mapped to -1 by expert_map).
    Ids are global when expert_map (G,) is given, else local; num_experts = E is the LOCAL count.
    """
    E = num_experts
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    if expert_map is not None:
        G = expert_map.numel()
        valid = (flat >= 0) & (flat < G)
        local = expert_map.long()[flat.clamp(0, G - 1)]
    else:
        valid = torch.ones_like(flat, dtype=torch.bool)
        local = flat
    valid &= (local >= 0) & (local < E)
    key = torch.where(valid, local, E)
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    seg = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    seg[1:] = counts[:E].cumsum(0)
    return order, seg.to(torch.int32)


def padded_capacity(num_rows: int, num_experts: int, block_m: int) -> int:
    """Length of a padded block table: every non-empty expert may waste block_m - 1 slots (a multiple of block_m)."""
    return _cdiv(num_rows + min(num_experts, num_rows) * (block_m - 1), block_m) * block_m


def pad_segments(seg_offsets: torch.Tensor, num_rows: int, block_m: int):
    """Block table over rows already grouped in per-expert segments [seg[e], seg[e+1]).

    Returns (slots int32 (EM,), expert_ids int32 (EM/block_m,), num_post_padded int32 (1,)):
    each expert's rows padded to a multiple of block_m, pad value `num_rows`; blocks past the end
    have expert id -1. EM = padded_capacity(num_rows, E, block_m); num_rows = total rows (static).
    """
    dev = seg_offsets.device
    E = seg_offsets.numel() - 1
    seg = seg_offsets.long()
    counts = seg[1:] - seg[:-1]
    padded = (counts + block_m - 1) // block_m * block_m
    incl = padded.cumsum(0)
    excl = incl - padded
    total = incl[-1:] if E > 0 else torch.zeros(1, dtype=torch.int64, device=dev)
    EM = padded_capacity(num_rows, E, block_m)
    rows = torch.arange(num_rows, device=dev)
    seg_of_row = torch.searchsorted(seg[1:].contiguous(), rows, right=True).clamp(max=max(E - 1, 0))
    in_seg = rows < seg[E]
    dest = torch.where(in_seg, excl[seg_of_row] + rows - seg[seg_of_row], EM)
    slots = torch.full((EM + 1,), num_rows, dtype=torch.int32, device=dev)
    slots.scatter_(0, dest, rows.to(torch.int32))
    starts = torch.arange(EM // block_m, device=dev, dtype=torch.int64) * block_m
    blk = torch.searchsorted(incl.contiguous(), starts, right=True)
    expert_ids = torch.where(starts < total, blk, -1).to(torch.int32)
    return slots[:EM], expert_ids, total.to(torch.int32)


def moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None):
    """Align pairs to expert blocks: (sorted_token_ids int32 (EM,), expert_ids int32 (EM/bs,), ntpp int32 (1,)).

    sorted_token_ids lists each local pair p = t*k + j once inside a block of its local expert,
    padded with T*k; expert_ids[b] is block b's local expert (-1 past num_tokens_post_padded);
    non-local pairs (expert_map -1) and ids outside the map/range are dropped, so no block has
    expert -1 below ntpp. num_experts = the LOCAL expert count (w.shape[0]); with expert_map (G,)
    the ids are global. EM = padded_capacity(T*k, num_experts, block_size).
    """
    topk = check_topk_ids(topk_ids)
    bs = _pos_int(block_size, "block_size")
    E = _pos_int(num_experts, "num_experts")
    emap = check_expert_map(expert_map, topk.device)
    P = topk.numel()
    order, seg = sort_pairs_by_expert(topk, E, emap)
    slots, expert_ids, ntpp = pad_segments(seg, P, bs)
    # slot -> pair id (pads keep the value P: order is extended with a sink holding P)
    order_ext = torch.cat([order.to(torch.int32), torch.full((1,), P, dtype=torch.int32, device=topk.device)])
    sorted_ids = order_ext[slots.long()]
    return sorted_ids, expert_ids, ntpp
