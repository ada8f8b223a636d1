"""OAI-style gather/scatter grouped GEMM: pairs permuted into contiguous per-expert segments.

permute_pairs sorts the local pairs by expert (segment e = rows [seg[e], seg[e+1]) of the permuted
layout, ascending pair index inside a segment). grouped_gemm computes in that layout (row i is pair
perm[i]): x rows are gathered through perm (or read in place when x is already permuted), the
rounding is fused_moe_gemm's (same kernel, rows addressed through a block table over the segments).
scatter_sum adds a token's rows back in slot order with fp32 accumulation, bit-identical to moe_sum.
"""
from __future__ import annotations

import torch

from moe_lora_harness.kernels.dtypes import FLOAT_DTYPES
from moe_lora_harness.kernels.triton.fused_moe_gemm import (
    FP8_CODES, GemmConfig, _tensor, check_block_m, check_weights, check_x_scales, choose_block_m, launch_gemm,
    routing_weights,
)
from moe_lora_harness.kernels.triton.moe_align import _pos_int, check_expert_map, check_topk_ids, pad_segments, sort_pairs_by_expert
from moe_lora_harness.kernels.triton.moe_sum import check_out, launch_sum
from moe_lora_harness.kernels.validate import UNCHECKED_ENV, checks_enabled


def permute_pairs(topk_ids, num_experts, expert_map=None):
    """(perm int64 (P_local,), seg_offsets int32 (E+1,)): local pairs p = t*k + j grouped by local expert.

    num_experts = E, the LOCAL expert count; with expert_map (G,) (global -> local, -1 = not local)
    the ids are global. Non-local pairs and ids out of range are dropped. One device->host sync
    (P_local is a shape).
    """
    topk = check_topk_ids(topk_ids)
    E = _pos_int(num_experts, "num_experts")
    emap = check_expert_map(expert_map, topk.device)
    order, seg = sort_pairs_by_expert(topk, E, emap)
    p_local = int(seg[-1])
    return order[:p_local].contiguous(), seg


def _perm(perm, dev) -> torch.Tensor:
    _tensor(perm, "perm", 1, "(P_local,) int64")
    if perm.dtype != torch.int64:
        raise TypeError(f"perm must be int64 (P_local,) (from permute_pairs); got {perm.dtype}")
    if perm.device != dev:
        raise ValueError(f"perm is on {perm.device}; it must be on the output's device {dev}")
    return perm.contiguous()


def _check_values(perm, seg, bound: int, what: str, unique: bool = False) -> None:
    """One fused sync: perm in [0, bound) (and unique), seg non-decreasing from 0 to P_local."""
    if not checks_enabled(perm.device):
        return
    P = perm.numel()
    flags = [((perm < 0) | (perm >= bound)).any() if P else torch.zeros((), dtype=torch.bool, device=perm.device)]
    msgs = [f"perm must hold pair ids in [0, {bound}) ({what})"]
    if seg is not None:
        s = seg.long()
        flags.append((s[0] != 0) | (s[-1] != P) | ((s[1:] - s[:-1]) < 0).any())
        msgs.append(f"seg_offsets must be non-decreasing from 0 to P_local = perm.numel() = {P}")
    if unique and P:
        cnt = torch.zeros(bound, dtype=torch.int32, device=perm.device)
        cnt.scatter_add_(0, perm.clamp(0, bound - 1), torch.ones_like(perm, dtype=torch.int32))
        flags.append((cnt > 1).any())
        msgs.append("perm must not repeat a pair")
    bad = torch.stack(flags).tolist()
    failed = [m for m, b in zip(msgs, bad) if b]
    if failed:
        raise ValueError("; ".join(failed) + f" (set {UNCHECKED_ENV}=1 to skip this check)")


def grouped_gemm(out, x, w, perm, seg_offsets, *, x_row_div, bias=None, topk_weights=None, mul_routed_weight=False,
                 x_permuted=False, block_m=None, quant=None, config: GemmConfig | None = None,
                 num_pairs: int | None = None) -> None:
    """In place, permuted layout: out[i] = rnd(w_p * (x[row] @ W[e_i]^T + bias[e_i])), p = perm[i], e_i its segment.

    out (P_local, N) dt; w (E, N, K) dt (or quant=QuantWeights, w=None); seg_offsets int32 (E+1,).
    x row: p // x_row_div (x (T, K) with x_row_div = k, or (T*k, K) with 1), or i when x_permuted
    (x (P_local, K) already in the permuted layout; x_row_div must be 1). w_p (fp32, topk_weights
    (T, k) flat at p) applies only with mul_routed_weight. block_m: rows per tile (default by size).
    """
    _tensor(out, "out", 2, "(P_local, N)")
    if out.dtype not in FLOAT_DTYPES:
        raise TypeError(f"out must be float16, bfloat16 or float32; got {out.dtype}")
    dt, dev = out.dtype, out.device
    _tensor(x, "x", 2, "(rows, K)")
    E, N, K, code = check_weights(w, quant, bias, dt, dev)
    if code in FP8_CODES:
        raise ValueError(f"grouped_gemm takes no FP8 weights (quant.scheme {quant.scheme!r}): use fused_moe_gemm")
    check_x_scales(x, None, code, dt, dev)
    p = _perm(perm, dev)
    P = p.numel()
    if tuple(out.shape) != (P, N):
        raise ValueError(f"out must have shape (P_local, N) = {(P, N)} (perm.numel(), weights' N); got {tuple(out.shape)}")
    seg = _tensor(seg_offsets, "seg_offsets", 1, "(E+1,) int32")
    if seg.dtype != torch.int32 or seg.numel() != E + 1 or seg.device != dev:
        raise ValueError(f"seg_offsets must be int32 (E+1,) = ({E + 1},) on {dev}; got {seg.dtype} "
                         f"{tuple(seg.shape)} on {seg.device}")
    if not isinstance(x_permuted, bool):
        raise TypeError(f"x_permuted must be a bool; got {x_permuted!r}")
    if isinstance(x_row_div, bool) or not isinstance(x_row_div, int) or x_row_div < 1:
        raise ValueError(f"x_row_div must be a positive int (top_k for x (T, K), 1 for x (T*k, K)); got {x_row_div!r}")
    if x_permuted:
        if x_row_div != 1 or tuple(x.shape) != (P, K):
            raise ValueError(f"x_permuted=True needs x of shape (P_local, K) = {(P, K)} and x_row_div=1; got "
                             f"{tuple(x.shape)}, x_row_div={x_row_div}")
    elif x.shape[1] != K:
        raise ValueError(f"x must have K = {K} columns (the weights' K); got {tuple(x.shape)}")
    tw = routing_weights(topk_weights, mul_routed_weight, topk_weights.numel() if isinstance(
        topk_weights, torch.Tensor) else 0, dev)
    # perm holds pair ids p = t*k + j below T*k: the routed weights' size, or x's rows times x_row_div; with x
    # already permuted and no weight read, only the caller knows T*k (num_pairs): under EP P_local < T*k
    if num_pairs is not None and (isinstance(num_pairs, bool) or not isinstance(num_pairs, int) or num_pairs < P):
        raise ValueError(f"num_pairs must be an int >= P_local = {P} (T*k); got {num_pairs!r}")
    bound = tw.numel() if tw is not None else (
        (num_pairs if num_pairs is not None else P) if x_permuted else x.shape[0] * x_row_div)
    if tw is not None and not x_permuted and x.shape[0] * x_row_div != tw.numel():
        raise ValueError(f"x must have T*k/x_row_div = {tw.numel() // x_row_div} rows (topk_weights holds "
                         f"T*k = {tw.numel()}); got {tuple(x.shape)}")
    seg = seg.contiguous()
    _check_values(p, seg, bound, "below T*k, the rows of x times x_row_div")
    bm = check_block_m(block_m if block_m is not None else choose_block_m(P, E))
    slots, eids, ntpp = pad_segments(seg, P, bm)
    launch_gemm(out, x, quant if code else w, bias, tw, slots, eids, ntpp, p, K=K, num_rows=P, x_row_div=x_row_div,
                use_perm=True, x_by_slot=x_permuted, block_m=bm, code=code, config=config)


def scatter_sum(out, y, perm, top_k) -> None:
    """In place: out[t] = rnd(sum over token t's local pairs, in slot order, of fp32(y[i])), 0 if none.

    out (T, H) dt; y (P_local, H) dt in the permuted layout (row i = pair perm[i], weights already
    applied); top_k = k. Bit-identical to moe_sum over the unpermuted (T, k, H) with non-local skipped.
    """
    _tensor(out, "out", 2, "(T, H)")
    _tensor(y, "y", 2, "(P_local, H)")
    if y.dtype not in FLOAT_DTYPES:
        raise TypeError(f"y must be float16, bfloat16 or float32; got {y.dtype}")
    k = _pos_int(top_k, "top_k")
    T, H = (int(s) for s in out.shape)
    check_out(out, T, y.shape[1], y.dtype, y.device)
    p = _perm(perm, y.device)
    if p.numel() != y.shape[0]:
        raise ValueError(f"y must have one row per entry of perm ({p.numel()}); got {tuple(y.shape)}")
    _check_values(p, None, T * k, "T*k = out.shape[0] * top_k", unique=True)
    inv = torch.full((T * k,), -1, dtype=torch.int32, device=y.device)
    if p.numel():
        inv.scatter_(0, p, torch.arange(p.numel(), device=y.device, dtype=torch.int32))
    launch_sum(out, y, inv, None, k, (y.stride(0), 0, y.stride(1)))
