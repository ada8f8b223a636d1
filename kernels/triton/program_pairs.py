"""Device functions of the LoRA grid that the one-shot and two-kernel kernels share: which (LoRA slot, local
expert) a program serves and whether it has work (the grid's early exits, spec 1.3), and its rows' pair ids."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def resolve_lora_expert(m_id, lora_idx, sub_start, top_k, max_loras, map_ptr, lora_ids_ptr, enabled_ptr,
                        ntpp_ptr, expert_ptr, stride_el, NAIVE: tl.constexpr, BLOCK_M: tl.constexpr):
    """(lora slot, local expert, valid) for a program: naive = pair m_id, sorted = lora_ids[lora_idx]."""
    if NAIVE:
        lora = tl.load(map_ptr + m_id // top_k)
    else:
        lora = tl.load(lora_ids_ptr + lora_idx)
    in_range = (lora >= 0) & (lora < max_loras)
    lora = tl.where(in_range, lora, 0).to(tl.int64)
    valid = in_range & (tl.load(enabled_ptr + lora) != 0)
    if NAIVE:
        expert = tl.load(expert_ptr + m_id)
    else:
        blk = sub_start // BLOCK_M
        valid = valid & (blk * BLOCK_M < tl.load(ntpp_ptr + lora))
        expert = tl.load(expert_ptr + lora * stride_el + blk)
    valid = valid & (expert >= 0)
    return lora, tl.where(valid, expert, 0).to(tl.int64), valid


@triton.jit
def block_tokens(m_id, lora, sub_start, num_pairs, em, sorted_ptr, stride_sl,
                 NAIVE: tl.constexpr, SUB_M: tl.constexpr):
    """Flat pair ids of a program's rows (int64, invalid rows clamped to 0) and their mask."""
    offs = tl.arange(0, SUB_M)
    if NAIVE:
        tok = tl.where(offs == 0, m_id, num_pairs).to(tl.int64)
    else:
        pos = sub_start + offs
        tok = tl.load(sorted_ptr + lora * stride_sl + pos, mask=pos < em, other=num_pairs).to(tl.int64)
    mask = (tok >= 0) & (tok < num_pairs)
    return tl.where(mask, tok, 0), mask
