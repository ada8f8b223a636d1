"""Pure-PyTorch eager implementation of the MoE-LoRA op (no Triton), in the working dtype.

Same signature and in-place contract as vLLM 0.33.0's `fused_moe_lora`, one-shot rounding points
(rank intermediate, delta and add each rounded to the output dtype; fp32 accumulation). Written
independently of reference/ so that the two check each other. Loops over (LoRA, expert) groups.
"""
from __future__ import annotations

import torch


def _qualifying_pairs(sorted_token_ids, expert_ids, num_tokens_post_padded, token_lora_mapping, top_k,
                      lora_ids, num_active_loras, adapter_enabled, num_pairs, max_loras, block_m):
    """(pair, lora, expert) int64 tensors of the pairs the production grid processes."""
    dev = token_lora_mapping.device
    enabled = adapter_enabled.to(dev).long()

    def ok_lora(l):
        return (l >= 0) & (l < max_loras) & (enabled[l.clamp(0, max_loras - 1)] != 0)

    if sorted_token_ids is None:
        p = torch.arange(num_pairs, device=dev)
        l = token_lora_mapping.long()[p // top_k] if num_pairs else p
        e = expert_ids.reshape(-1).long()[:num_pairs]
        keep = ok_lora(l) & (e >= 0)
        return p[keep], l[keep], e[keep]
    sids = sorted_token_ids.reshape(max_loras, -1).long()
    eids = expert_ids.reshape(max_loras, -1).long()
    em = sids.shape[1]
    n_active = int(num_active_loras.reshape(-1)[0]) if torch.is_tensor(num_active_loras) else int(num_active_loras)
    ps, ls, es = [], [], []
    for idx in range(min(n_active, lora_ids.numel())):
        l = int(lora_ids[idx])
        if l < 0 or l >= max_loras or int(enabled[l]) == 0:
            continue
        ntpp = min(int(num_tokens_post_padded[l]), em)
        pos = torch.arange(ntpp, device=dev)
        tok = sids[l, :ntpp]
        e = eids[l].gather(0, (pos // block_m).clamp(max=eids.shape[1] - 1)) if ntpp else pos
        e = torch.where(pos // block_m < eids.shape[1], e, torch.full_like(e, -1))
        keep = (tok < num_pairs) & (tok >= 0) & (e >= 0)
        ps.append(tok[keep]); es.append(e[keep]); ls.append(torch.full_like(tok[keep], l))
    if not ps:
        z = torch.zeros(0, dtype=torch.long, device=dev)
        return z, z, z
    return torch.cat(ps), torch.cat(ls), torch.cat(es)


def fused_moe_lora(output, qcurr_hidden_states, lora_a_stacked, lora_b_stacked, topk_weights,
                   sorted_token_ids, expert_ids, num_tokens_post_padded, token_lora_mapping, max_lora_rank,
                   top_k_num, lora_ids, num_active_loras, adapter_enabled,
                   shrink_block_size_m=16, shrink_block_size_n=64, shrink_block_size_k=32,
                   shrink_group_size_m=8, shrink_num_warps=4, shrink_num_stages=3, shrink_split_k=1,
                   expand_block_size_m=16, expand_block_size_n=64, expand_block_size_k=32,
                   expand_group_size_m=8, expand_num_warps=4, expand_num_stages=3, expand_split_k=1,
                   mul_routed_weight=False, fully_sharded=False, offset=0, add_inputs=True, *,
                   collective=None):
    """In place: output[t, j, offset + s*N : ...] (+)= rnd(w * B_s rnd(A_s x_row)) for qualifying pairs."""
    from moe_lora_harness.kernels.validate import TUNING_PARAMS, check_value_ranges, validate_call
    loc = locals()
    tuning = {n: loc[n] for n in TUNING_PARAMS}
    call = validate_call(output, qcurr_hidden_states, lora_a_stacked, lora_b_stacked, topk_weights,
                         sorted_token_ids, expert_ids, num_tokens_post_padded, token_lora_mapping,
                         max_lora_rank, top_k_num, lora_ids, num_active_loras, adapter_enabled, tuning,
                         mul_routed_weight, fully_sharded, offset, add_inputs)
    check_value_ranges(call)
    T, k = topk_weights.shape
    L = lora_a_stacked[0].shape[0]
    dt = output.dtype
    pair, lora, expert = _qualifying_pairs(sorted_token_ids, expert_ids, num_tokens_post_padded,
                                           token_lora_mapping, k, lora_ids, num_active_loras,
                                           adapter_enabled, T * k, L, shrink_block_size_m)
    if pair.numel() == 0:
        return
    x_row = pair if mul_routed_weight else pair // top_k_num
    x = qcurr_hidden_states.float()
    flat = output.view(T * k, output.shape[-1])
    w = topk_weights.reshape(-1).float()
    # group pairs by (lora, expert) so each factor pair is one GEMM; shrink for all, then expand
    E = int(expert.max()) + 1   # expert ids of qualifying pairs are >= 0 here
    key = lora * (E + 1) + expert
    groups = []
    for kv in torch.unique(key).tolist():
        sel = key == kv
        groups.append((kv // (E + 1), kv % (E + 1), pair[sel], x_row[sel]))
    R = lora_a_stacked[0].shape[2]
    cache = torch.zeros(len(lora_a_stacked), T * k, R, dtype=dt, device=output.device)
    for l, e, rows, xrows in groups:
        xr = x[xrows]
        for s, A in enumerate(lora_a_stacked):
            a = A[l, e if A.shape[1] > 1 else 0].float()        # (R, K)
            cache[s, rows] = (xr @ a.t()).to(dt)               # rank intermediate rounded to dt
    if fully_sharded and collective is not None:
        cache = collective(cache)
    for l, e, rows, _ in groups:
        for s, B in enumerate(lora_b_stacked):
            b = B[l, e if B.shape[1] > 1 else 0].float()        # (N, R)
            d = cache[s, rows].float() @ b.t()
            if mul_routed_weight:
                d = d * w[rows].unsqueeze(1)
            d = d.to(dt)
            N = b.shape[0]
            cols = slice(offset + s * N, offset + (s + 1) * N)
            if add_inputs:
                flat[rows, cols] = (flat[rows, cols].float() + d.float()).to(dt)
            else:
                flat[rows, cols] = d
