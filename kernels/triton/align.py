"""`moe_lora_align_block_size` on the device (spec 2): per-LoRA expert buckets padded to the block size.

Vectorised torch ops over (LoRA, expert, pair) with no host loop and no device->host sync (so it can
be captured in a CUDA graph): bucket counts by scatter-add, padded exclusive prefix sums, a stable
sort that places pairs in ascending flat-pair order inside each bucket, block -> expert by
searchsorted. Rows of skipped slots (lora id -1 or >= L, adapter disabled) are left untouched.
"""
from __future__ import annotations

import torch


def _i32(t, arg: str, expect: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg} must be an int32 torch.Tensor {expect}; got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{arg} must be int32 {expect}; got dtype {t.dtype}")
    return t


def _pos_int(v, arg: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{arg} must be a positive int; got {v!r}")
    return v


def _rows(buf: torch.Tensor, arg: str, L: int, width: int) -> torch.Tensor:
    """A (L, width) view of a (L*width,) or (L, width) contiguous buffer (written in place)."""
    if buf.numel() != L * width or buf.dim() not in (1, 2) or (buf.dim() == 2 and tuple(buf.shape) != (L, width)):
        raise ValueError(f"{arg} must have shape ({L * width},) or ({L}, {width}); got {tuple(buf.shape)}")
    if not buf.is_contiguous():
        raise ValueError(f"{arg} must be contiguous (it is written in place through a flat view)")
    return buf.view(L, width)


def moe_lora_align_block_size(
    topk_ids, token_lora_mapping, num_experts, block_size, max_loras, max_num_tokens_padded,
    max_num_m_blocks, sorted_token_ids, experts_ids, num_tokens_post_pad, adapter_enabled, lora_ids,
    expert_map=None,
) -> None:
    """Fill sorted_token_ids / experts_ids / num_tokens_post_pad in place with vLLM's schema and semantics.

    For each slot i of lora_ids with l = lora_ids[i] in [0, L) and adapter_enabled[l] != 0: the pairs
    p = t*k + j with token_lora_mapping[t] == l and a valid expert (in [0, num_experts), mapped through
    expert_map global -> local, -1 dropped) are bucketed by expert, each bucket padded to block_size
    with the pad value T*k; experts_ids holds each block's expert and -1 past the end; ntpp[l] is the
    padded total. Bucket order inside a block: ascending flat pair index (vLLM's is unspecified).
    """
    topk = _i32(topk_ids, "topk_ids", "(T, k)")
    if topk.dim() != 2:
        raise ValueError(f"topk_ids must be 2-D (T, k); got shape {tuple(topk.shape)}")
    mapping = _i32(token_lora_mapping, "token_lora_mapping", "(T,)")
    T, k = topk.shape
    if mapping.dim() != 1 or mapping.shape[0] != T:
        raise ValueError(f"token_lora_mapping must have shape (T,)=({T},); got {tuple(mapping.shape)}")
    E = _pos_int(num_experts, "num_experts")
    bs = _pos_int(block_size, "block_size")
    L = _pos_int(max_loras, "max_loras")
    M = _pos_int(max_num_tokens_padded, "max_num_tokens_padded")
    MB = _pos_int(max_num_m_blocks, "max_num_m_blocks")
    if -(-E // 32) * 32 >= 1024:
        raise ValueError(f"num_experts={E}: round_up(num_experts, 32) must be < 1024 (vLLM's align limit)")
    sids = _rows(_i32(sorted_token_ids, "sorted_token_ids", "(L*M,) or (L, M)"), "sorted_token_ids", L, M)
    eids = _rows(_i32(experts_ids, "experts_ids", "(L*MB,) or (L, MB)"), "experts_ids", L, MB)
    ntpp = _i32(num_tokens_post_pad, "num_tokens_post_pad", "(L,)")
    if ntpp.dim() != 1 or ntpp.shape[0] != L:
        raise ValueError(f"num_tokens_post_pad must have shape (L,)=({L},); got {tuple(ntpp.shape)}")
    enabled = _i32(adapter_enabled, "adapter_enabled", "(L+1,)")
    ids = _i32(lora_ids, "lora_ids", "(L+1,)")
    if enabled.dim() != 1 or enabled.shape[0] < L:
        raise ValueError(f"adapter_enabled must have shape (L+1,)=({L + 1},); got {tuple(enabled.shape)}")
    if ids.dim() != 1:
        raise ValueError(f"lora_ids must be 1-D (L+1,); got shape {tuple(ids.shape)}")
    if expert_map is not None:
        emap = _i32(expert_map, "expert_map", "(num_experts,)")
        if emap.dim() != 1 or emap.shape[0] != E:
            raise ValueError(f"expert_map must have shape (num_experts,)=({E},); got {tuple(emap.shape)}")
    dev = topk.device
    for arg, t in (("token_lora_mapping", mapping), ("sorted_token_ids", sids), ("experts_ids", eids),
                   ("num_tokens_post_pad", ntpp), ("adapter_enabled", enabled), ("lora_ids", ids)) + (
                   (("expert_map", expert_map),) if expert_map is not None else ()):
        if t.device != dev:
            raise ValueError(f"{arg} is on {t.device}; every tensor must be on topk_ids' device {dev}")

    numel = T * k
    # Rows to write: LoRAs named by a slot of lora_ids, in range and enabled.
    lid = ids.long()
    ok = (lid >= 0) & (lid < L)
    active = torch.zeros(L + 1, dtype=torch.bool, device=dev).index_fill_(0, torch.where(ok, lid, L), True)[:L]
    active &= enabled[:L] != 0

    # Bucket key per pair: lora * E + local expert; invalid pairs get the key L*E (sorted last, dropped).
    flat = topk.reshape(-1).long()
    lora = mapping.long().repeat_interleave(k) if numel else flat
    valid = (flat >= 0) & (flat < E) & (lora >= 0) & (lora < L)
    expert = flat.clamp(0, E - 1)
    if expert_map is not None:
        expert = expert_map.long()[expert]
        valid &= (expert >= 0) & (expert < E)
    valid &= active[lora.clamp(0, L - 1)]
    key = torch.where(valid, lora.clamp(0, L - 1) * E + expert.clamp(0, E - 1), L * E)

    counts = torch.zeros(L * E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    padded = ((counts[: L * E] + bs - 1) // bs * bs).view(L, E)
    incl = padded.cumsum(1)
    excl = incl - padded
    total = incl[:, -1]

    # Rank of each pair inside its bucket (ascending pair index: a stable sort by key).
    order = torch.sort(key, stable=True).indices
    key_sorted = key[order]
    first = counts.cumsum(0) - counts  # start of each key's run in sorted order
    rank = torch.arange(numel, device=dev) - first[key_sorted]
    keep = key_sorted < L * E
    row = key_sorted // E
    dest = row * M + excl.view(-1)[key_sorted.clamp(max=L * E - 1)] + rank
    keep &= (excl.view(-1)[key_sorted.clamp(max=L * E - 1)] + rank) < M  # never write past a row
    new_sorted = torch.full((L * M + 1,), numel, dtype=torch.int32, device=dev)  # last element: a sink
    new_sorted.scatter_(0, torch.where(keep, dest, L * M), order.to(torch.int32))
    new_sorted = new_sorted[: L * M].view(L, M)

    starts = torch.arange(MB, device=dev, dtype=torch.int64) * bs
    blk_expert = torch.searchsorted(incl.contiguous(), starts.expand(L, MB).contiguous(), right=True)
    new_eids = torch.where(starts[None, :] < total[:, None], blk_expert, -1).to(torch.int32)

    sids.copy_(torch.where(active[:, None], new_sorted, sids))
    eids.copy_(torch.where(active[:, None], new_eids, eids))
    ntpp.copy_(torch.where(active, total.to(torch.int32), ntpp))
