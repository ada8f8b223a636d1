"""Pure-PyTorch eager implementation of the MoE-LoRA op (no Triton), in the working dtype.

vLLM 0.33.0's `fused_moe_lora` signature (op_contract) and in-place contract, one-shot rounding points
(rank intermediate, delta and add each rounded to the output dtype; fp32 accumulation). Written
independently of reference/ so that the two check each other. Loops over (LoRA, expert) groups.
"""
from __future__ import annotations

import torch

from moe_lora_harness.kernels.validate import check_launchable, check_value_ranges
from moe_lora_harness.op_contract.call import OpCall
from moe_lora_harness.op_contract.entry import vllm_op


def _qualifying_pairs(sorted_token_ids, expert_ids, num_tokens_post_padded, token_lora_mapping, top_k,
                      lora_ids, n_active, adapter_enabled, num_pairs, max_loras, block_m):
    """(pair, lora, expert) int64 tensors of the pairs the production grid processes (n_active: an int)."""
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


@vllm_op
def fused_moe_lora(call: OpCall, *, collective=None) -> None:
    """In place: output[t, j, offset + s*N : ...] (+)= rnd(w * B_s rnd(A_s x_row)) for qualifying pairs."""
    check_launchable(call)
    check_value_ranges(call)
    T, k, L = call.num_tokens, call.top_k, call.max_loras
    output = call.output
    dt = output.dtype
    pair, lora, expert = _qualifying_pairs(call.sorted_token_ids, call.expert_ids, call.num_tokens_post_padded,
                                           call.token_lora_mapping, k, call.lora_ids, call.num_active,
                                           call.adapter_enabled, T * k, L, call.block_m)
    if pair.numel() == 0:
        return
    x_row = pair if call.mul_routed_weight else pair // k
    x = call.x.float()
    flat = output.view(T * k, output.shape[-1])
    w = call.weights.float()
    # group pairs by (lora, expert) so each factor pair is one GEMM; shrink for all, then expand
    E = int(expert.max()) + 1   # expert ids of qualifying pairs are >= 0 here
    key = lora * (E + 1) + expert
    groups = []
    for kv in torch.unique(key).tolist():
        sel = key == kv
        groups.append((kv // (E + 1), kv % (E + 1), pair[sel], x_row[sel]))
    cache = torch.zeros(call.num_slices, T * k, call.rank, dtype=dt, device=output.device)
    for l, e, rows, xrows in groups:
        xr = x[xrows]
        for s, A in enumerate(call.lora_a):
            a = A[l, e if A.shape[1] > 1 else 0].float()        # (R, K)
            cache[s, rows] = (xr @ a.t()).to(dt)               # rank intermediate rounded to dt
    if call.fully_sharded and collective is not None:
        cache = collective(cache)
    for l, e, rows, _ in groups:
        for s, B in enumerate(call.lora_b):
            b = B[l, e if B.shape[1] > 1 else 0].float()        # (N, R)
            d = cache[s, rows].float() @ b.t()
            if call.mul_routed_weight:
                d = d * w[rows].unsqueeze(1)
            d = d.to(dt)
            N = b.shape[0]
            cols = slice(call.offset + s * N, call.offset + (s + 1) * N)
            if call.add_inputs:
                flat[rows, cols] = (flat[rows, cols].float() + d.float()).to(dt)
            else:
                flat[rows, cols] = d
