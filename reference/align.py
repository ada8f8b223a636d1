"""Reference of vLLM's `moe_lora_align_block_size` (spec 2): per-LoRA expert-sorted, block-padded pairs.

Exact integer semantics. Inside one expert bucket this reference orders pairs by ascending flat
pair index; the CUDA kernels use atomicAdd / thread-strided order, so compare with `check_align`
(per-block sets), never element by element.
"""

from __future__ import annotations

from collections import Counter

import torch

DEFAULT_FILL = -7  # sentinel for "never written" in align_alloc's sorted ids / ntpp
_MAX_MESSAGES = 20


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _i32(t, arg: str, dims: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        got = f"dtype {t.dtype}, shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{arg} must be an int32 torch.Tensor; got {got}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{arg} must be {dims}-D; got shape {tuple(t.shape)}")
    return t


def _pos_int(v, arg: str, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{arg} must be an int >= {minimum}; got {v!r}")
    return v


def _check_experts(num_experts: int, expert_map) -> None:
    _pos_int(num_experts, "num_experts")
    padded = _cdiv(num_experts, 32) * 32
    if padded >= 1024:
        raise ValueError(f"num_experts rounded up to 32 must be < 1024 (vLLM's limit); got {num_experts} -> {padded}")
    if expert_map is not None:
        _i32(expert_map, "expert_map", 1)
        if expert_map.numel() != num_experts:
            raise ValueError(
                f"expert_map must have shape (num_experts,)=({num_experts},) (global experts); "
                f"got {tuple(expert_map.shape)}"
            )
        if bool(((expert_map < -1) | (expert_map >= num_experts)).any()):
            raise ValueError("expert_map values must be -1 (not local) or local ids in [0, num_experts)")


def active_lora_ids(token_lora_mapping: torch.Tensor, max_loras: int) -> torch.Tensor:
    """(L+1,) int32: sorted unique slots of the mapping, then -1 padding (-1 first if a token has none)."""
    m = _i32(token_lora_mapping, "token_lora_mapping", 1)
    L = _pos_int(max_loras, "max_loras")
    if m.numel() and bool(((m < -1) | (m >= L)).any()):
        raise ValueError(f"token_lora_mapping values must be -1 or slots in [0, max_loras={L})")
    out = torch.full((L + 1,), -1, dtype=torch.int32, device=m.device)
    u = torch.unique(m, sorted=True)
    out[: u.numel()] = u.to(torch.int32)
    return out


def align_sizes(num_pairs: int, block_size: int, num_experts: int, expert_map=None) -> tuple[int, int]:
    """(max_num_tokens_padded, max_num_m_blocks) as PunicaWrapperGPU allocates them (spec 2.1)."""
    _pos_int(num_pairs, "num_pairs", 0)
    bs = _pos_int(block_size, "block_size")
    kne = expert_map.numel() if expert_map is not None else _pos_int(num_experts, "num_experts")
    padded = num_pairs + kne * (bs - 1)
    if num_pairs < kne:
        padded = num_pairs * bs
    return padded, _cdiv(padded, bs)


def align_alloc(topk_ids, block_size, num_experts, max_loras, expert_map=None, fill=None):
    """Output buffers for the align: sorted ids (L, M) and ntpp (L,) filled with `fill`, expert ids -1."""
    _i32(topk_ids, "topk_ids", 2)
    L = _pos_int(max_loras, "max_loras")
    fill = DEFAULT_FILL if fill is None else int(fill)
    M, MB = align_sizes(topk_ids.numel(), block_size, num_experts, expert_map)
    dev = topk_ids.device
    sorted_ids = torch.full((L, M), fill, dtype=torch.int32, device=dev)
    expert_ids = torch.full((L, MB), -1, dtype=torch.int32, device=dev)
    ntpp = torch.full((L,), fill, dtype=torch.int32, device=dev)
    return sorted_ids, expert_ids, ntpp


def _as_rows(t: torch.Tensor, arg: str, L: int, width: int) -> torch.Tensor:
    """View a 1-D (L*width) or 2-D (L, width) buffer as (L, width), sharing storage."""
    if t.dim() == 1 and t.numel() == L * width:
        return t.view(L, width)
    if t.dim() == 2 and tuple(t.shape) == (L, width):
        return t
    raise ValueError(f"{arg} must have shape ({L * width},) or ({L}, {width}); got {tuple(t.shape)}")


def _slot_active(l: int, L: int, enabled: torch.Tensor) -> bool:
    return 0 <= l < L and int(enabled[l]) != 0


def _align_one(topk_flat, mapping, k, l, num_experts, bs, expert_map):
    """(sorted row content up to total, expert per block, total) for LoRA slot l."""
    e = topk_flat.long()
    valid = (e >= 0) & (e < num_experts)
    if expert_map is not None:
        local = torch.full_like(e, -1)
        local[valid] = expert_map.long()[e[valid]]
        e = local
        valid = e >= 0
    tok = torch.div(torch.arange(e.numel(), device=e.device), k, rounding_mode="floor")
    valid &= mapping.long()[tok] == l
    idx = torch.nonzero(valid).flatten()
    ev = e[idx]
    counts = torch.bincount(ev, minlength=num_experts)
    padded = torch.div(counts + bs - 1, bs, rounding_mode="floor") * bs
    start = torch.cumsum(padded, 0) - padded
    total = int(padded.sum())
    order = torch.argsort(ev, stable=True)  # ascending flat index inside each expert bucket
    ev, idx = ev[order], idx[order]
    rank_in_bucket = torch.arange(ev.numel(), device=e.device) - (torch.cumsum(counts, 0) - counts)[ev]
    pos = start[ev] + rank_in_bucket
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=e.device), padded // bs)
    return pos, idx, block_expert, total


def moe_lora_align_block_size(
    topk_ids: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    num_experts: int,
    block_size: int,
    max_loras: int,
    max_num_tokens_padded: int,
    max_num_m_blocks: int,
    sorted_token_ids: torch.Tensor,
    experts_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
    adapter_enabled: torch.Tensor,
    lora_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> None:
    """In place, vLLM's schema (spec 2.2): for each active, enabled slot l in lora_ids, fill row l.

    Row l of sorted_token_ids = pad value T*k everywhere, then each expert's pairs of LoRA l at
    its block-aligned bucket; experts_ids[l, b] = bucket expert, -1 past the padded total;
    num_tokens_post_pad[l] = padded total. Skipped slots' rows are left untouched.
    """
    _i32(topk_ids, "topk_ids", 2)
    mapping = _i32(token_lora_mapping, "token_lora_mapping", 1)
    T, k = topk_ids.shape
    if mapping.numel() != T:
        raise ValueError(f"token_lora_mapping must have shape (T,)=({T},); got {tuple(mapping.shape)}")
    _check_experts(num_experts, expert_map)
    bs = _pos_int(block_size, "block_size")
    L = _pos_int(max_loras, "max_loras")
    M = _pos_int(max_num_tokens_padded, "max_num_tokens_padded", 0)
    MB = _pos_int(max_num_m_blocks, "max_num_m_blocks", 0)
    rows = _as_rows(_i32(sorted_token_ids, "sorted_token_ids"), "sorted_token_ids", L, M)
    erows = _as_rows(_i32(experts_ids, "experts_ids"), "experts_ids", L, MB)
    ntpp = _i32(num_tokens_post_pad, "num_tokens_post_pad", 1)
    if ntpp.numel() != L:
        raise ValueError(f"num_tokens_post_pad must have shape (L,)=({L},); got {tuple(ntpp.shape)}")
    enabled = _i32(adapter_enabled, "adapter_enabled", 1)
    ids = _i32(lora_ids, "lora_ids", 1)
    if enabled.numel() < L:
        raise ValueError(f"adapter_enabled must have shape (L+1,)=({L + 1},); got {tuple(enabled.shape)}")
    numel = topk_ids.numel()
    flat = topk_ids.reshape(-1)
    for l in (int(v) for v in ids.tolist()):
        if not _slot_active(l, L, enabled):
            continue
        pos, idx, block_expert, total = _align_one(flat, mapping, k, l, num_experts, bs, expert_map)
        if total > M or total // bs > MB:
            raise ValueError(
                f"LoRA slot {l} needs {total} padded positions ({total // bs} blocks) but "
                f"max_num_tokens_padded={M}, max_num_m_blocks={MB}; allocate with align_sizes()"
            )
        rows[l].fill_(numel)
        rows[l, pos] = idx.to(torch.int32)
        erows[l].fill_(-1)
        erows[l, : block_expert.numel()] = block_expert.to(torch.int32)
        ntpp[l] = total


def _fmt_list(xs) -> str:
    xs = list(xs)
    return str(xs) if len(xs) <= 12 else f"{xs[:12]}... ({len(xs)} entries)"


def check_align(
    topk_ids,
    token_lora_mapping,
    num_experts,
    block_size,
    max_loras,
    sorted_token_ids,
    experts_ids,
    num_tokens_post_pad,
    adapter_enabled,
    lora_ids,
    expert_map=None,
    untouched_fill=None,
) -> list[str]:
    """Violations (empty list = valid) of a candidate align output against this reference.

    Per active slot: ntpp and expert_ids exact; each expert bucket (its run of blocks) holds the
    reference's pairs and pad values as a multiset (order inside a bucket is unspecified, so a pair
    may sit in any block of its bucket); every position past the padded total holds the pad T*k.
    Skipped slots (with untouched_fill): sorted ids and ntpp rows still equal to the sentinel,
    expert_ids rows still -1.
    """
    L = _pos_int(max_loras, "max_loras")
    ref_s, ref_e, ref_n = align_alloc(topk_ids, block_size, num_experts, L, expert_map, fill=untouched_fill)
    M, MB = ref_s.shape[1], ref_e.shape[1]
    cand_s = _as_rows(_i32(sorted_token_ids, "sorted_token_ids"), "sorted_token_ids", L, M)
    cand_e = _as_rows(_i32(experts_ids, "experts_ids"), "experts_ids", L, MB)
    cand_n = _i32(num_tokens_post_pad, "num_tokens_post_pad", 1)
    moe_lora_align_block_size(
        topk_ids, token_lora_mapping, num_experts, block_size, L, M, MB, ref_s, ref_e, ref_n,
        adapter_enabled, lora_ids, expert_map,
    )
    cand_s, cand_e, cand_n = cand_s.cpu(), cand_e.cpu(), cand_n.cpu()
    ref_s, ref_e, ref_n = ref_s.cpu(), ref_e.cpu(), ref_n.cpu()
    numel, bs = topk_ids.numel(), block_size
    active = {int(l) for l in lora_ids.tolist() if _slot_active(int(l), L, adapter_enabled.cpu())}
    msgs: list[str] = []
    for l in range(L):
        if l not in active:
            if untouched_fill is not None:
                if bool((cand_s[l] != untouched_fill).any()) or int(cand_n[l]) != untouched_fill:
                    msgs.append(f"slot {l}: skipped (inactive/disabled) but sorted_token_ids/ntpp row was written")
                if bool((cand_e[l] != -1).any()):
                    msgs.append(f"slot {l}: skipped (inactive/disabled) but experts_ids row was written")
            continue
        total = int(ref_n[l])
        if int(cand_n[l]) != total:
            msgs.append(f"slot {l}: num_tokens_post_pad = {int(cand_n[l])}, expected {total}")
        if not torch.equal(cand_e[l], ref_e[l]):
            bad = torch.nonzero(cand_e[l] != ref_e[l]).flatten().tolist()
            msgs.append(
                f"slot {l}: experts_ids differ at blocks {_fmt_list(bad)}: got "
                f"{_fmt_list(cand_e[l, bad].tolist())}, expected {_fmt_list(ref_e[l, bad].tolist())}"
            )
        nblk = total // bs
        b0 = 0
        while b0 < nblk:  # one expert bucket = the run of blocks carrying the same expert
            b1 = b0
            while b1 < nblk and int(ref_e[l, b1]) == int(ref_e[l, b0]):
                b1 += 1
            got = Counter(cand_s[l, b0 * bs : b1 * bs].tolist())
            exp = Counter(ref_s[l, b0 * bs : b1 * bs].tolist())
            if got != exp:
                msgs.append(
                    f"slot {l} expert {int(ref_e[l, b0])} (blocks {b0}..{b1 - 1}): missing "
                    f"{_fmt_list(sorted((exp - got).elements()))}, unexpected "
                    f"{_fmt_list(sorted((got - exp).elements()))} (pad value {numel})"
                )
            b0 = b1
        tail = cand_s[l, total:]
        if bool((tail != numel).any()):
            bad = (torch.nonzero(tail != numel).flatten() + total).tolist()
            msgs.append(f"slot {l}: positions {_fmt_list(bad)} past the padded total {total} are not the pad value {numel}")
    if len(msgs) > _MAX_MESSAGES:
        msgs = msgs[:_MAX_MESSAGES] + [f"... and {len(msgs) - _MAX_MESSAGES} more violations"]
    return msgs
