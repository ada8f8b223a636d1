"""Two-kernel MoE-LoRA path: shrink into an HBM rank cache, (collective,) then expand. Any rank.

Numerics (vLLM 0.33.0 legacy path, spec 1.6, split_k = 1): cache = fp32 x.A^T rounded to the output
dtype, stored (S, T, k, R); under fully_sharded the cache is joined across ranks (w13: all_gather on
the rank dim in rank order; w2: all_reduce sum) by torch.distributed when a process group is up, by
a caller's `collective` hook, or not at all (single rank); then d = fp32 cache.B^T (times fp32
routing weight) rounded once, and out = prev + d in the output dtype.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from moe_lora_harness.kernels.triton.launch import block_k_for, bucket_stats, launch, next_pow2, slice_pairs
from moe_lora_harness.kernels.triton.program_pairs import block_tokens, resolve_lora_expert
from moe_lora_harness.op_contract.call import MoELoRAArgumentError, OpCall


def choose_sub_m(call: OpCall) -> int:
    """Rows per program of both kernels, from the pairs per (LoRA, expert) bucket (H200 sweeps, first
    session). Its own rule: the one-shot kernel's refit, when shared, made this path up to 24% slower."""
    if call.naive:
        return 16
    _, per_bucket = bucket_stats(call)
    if per_bucket < 4:
        sub_m = 16
    elif per_bucket < 32:
        sub_m = 64 if call.hidden >= 8192 else 32
    else:
        sub_m = 64
    return min(sub_m, call.block_m)


@triton.jit
def _shrink_kernel(
    x_ptr, a0_ptr, a1_ptr, cache_ptr, sorted_ptr, expert_ptr, ntpp_ptr, map_ptr, lora_ids_ptr, enabled_ptr,
    K, R, num_pairs, top_k, max_loras, em, r_tiles, slice0,
    stride_xm, stride_xk, stride_al, stride_ae, stride_ar, stride_ak, stride_cs, stride_cp, stride_cr,
    stride_sl, stride_el,
    X_ROW_DIV: tl.constexpr, NAIVE: tl.constexpr, BLOCK_M: tl.constexpr, SUB_M: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
):
    """Grid (m programs * rank tiles, slices in this launch, active LoRAs): cache[s, p, r] = rnd(x_p . A[r])."""
    pid0 = tl.program_id(0)
    pid_s = tl.program_id(1)
    m_id = pid0 // r_tiles
    r_id = pid0 % r_tiles
    sub_start = m_id * SUB_M
    lora, expert, valid = resolve_lora_expert(
        m_id, tl.program_id(2), sub_start, top_k, max_loras, map_ptr, lora_ids_ptr, enabled_ptr,
        ntpp_ptr, expert_ptr, stride_el, NAIVE, BLOCK_M)
    if valid == 0:
        return
    tok, tmask = block_tokens(m_id, lora, sub_start, num_pairs, em, sorted_ptr, stride_sl, NAIVE, SUB_M)
    if tl.sum(tmask.to(tl.int32), axis=0) == 0:
        return
    a_ptr = a0_ptr
    if pid_s == 1:
        a_ptr = a1_ptr
    offs_r = r_id * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = offs_r < R
    r_safe = tl.where(rmask, offs_r, 0)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (tok // X_ROW_DIV)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    a_ptrs = a_ptr + lora * stride_al + expert * stride_ae + r_safe[None, :] * stride_ar + offs_k[:, None] * stride_ak
    acc = tl.zeros((SUB_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=tmask[:, None], other=0.0)
            at = tl.load(a_ptrs, mask=rmask[None, :], other=0.0)
        else:
            kmask = offs_k < K - k0
            xt = tl.load(x_ptrs, mask=tmask[:, None] & kmask[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=kmask[:, None] & rmask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(xt, at, acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, at, acc)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    c_ptrs = cache_ptr + (slice0 + pid_s) * stride_cs + tok[:, None] * stride_cp + offs_r[None, :] * stride_cr
    tl.store(c_ptrs, acc.to(cache_ptr.dtype.element_ty), mask=tmask[:, None] & rmask[None, :])


@triton.jit
def _expand_kernel(
    cache_ptr, b0_ptr, b1_ptr, out_ptr, w_ptr, sorted_ptr, expert_ptr, ntpp_ptr, map_ptr, lora_ids_ptr, enabled_ptr,
    N, R, num_pairs, top_k, max_loras, em, n_tiles, slice0, col0,
    stride_cs, stride_cp, stride_cr, stride_bl, stride_be, stride_bn, stride_br, stride_om, stride_on,
    stride_sl, stride_el,
    NAIVE: tl.constexpr, MUL_W: tl.constexpr, ADD_INPUTS: tl.constexpr, BLOCK_M: tl.constexpr,
    SUB_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KR: tl.constexpr, IEEE: tl.constexpr,
):
    """Grid (m programs * N tiles, slices in this launch, active LoRAs): out = prev + rnd(w * cache . B^T)."""
    pid0 = tl.program_id(0)
    pid_s = tl.program_id(1)
    m_id = pid0 // n_tiles
    n_id = pid0 % n_tiles
    sub_start = m_id * SUB_M
    lora, expert, valid = resolve_lora_expert(
        m_id, tl.program_id(2), sub_start, top_k, max_loras, map_ptr, lora_ids_ptr, enabled_ptr,
        ntpp_ptr, expert_ptr, stride_el, NAIVE, BLOCK_M)
    if valid == 0:
        return
    tok, tmask = block_tokens(m_id, lora, sub_start, num_pairs, em, sorted_ptr, stride_sl, NAIVE, SUB_M)
    if tl.sum(tmask.to(tl.int32), axis=0) == 0:
        return
    b_ptr = b0_ptr
    col = col0
    if pid_s == 1:
        b_ptr = b1_ptr
        col = col0 + N
    cols = n_id * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = cols < N
    offs_kr = tl.arange(0, BLOCK_KR)
    c_ptrs = cache_ptr + (slice0 + pid_s) * stride_cs + tok[:, None] * stride_cp + offs_kr[None, :] * stride_cr
    b_ptrs = b_ptr + lora * stride_bl + expert * stride_be + offs_kr[:, None] * stride_br + cols[None, :] * stride_bn
    acc = tl.zeros((SUB_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_KR):
        kmask = offs_kr < R - r0
        ct = tl.load(c_ptrs, mask=tmask[:, None] & kmask[None, :], other=0.0)
        bt = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(ct, bt, acc, input_precision="ieee")
        else:
            acc = tl.dot(ct, bt, acc)
        c_ptrs += BLOCK_KR * stride_cr
        b_ptrs += BLOCK_KR * stride_br
    if MUL_W:
        acc = acc * tl.load(w_ptr + tok, mask=tmask, other=0.0).to(tl.float32)[:, None]
    d = acc.to(out_ptr.dtype.element_ty)
    optrs = out_ptr + tok[:, None] * stride_om + (col + cols)[None, :] * stride_on
    omask = tmask[:, None] & nmask[None, :]
    if ADD_INPUTS:
        d = tl.load(optrs, mask=omask, other=0.0) + d
    tl.store(optrs, d, mask=omask)


def _default_collective(cache: torch.Tensor, gather: bool) -> torch.Tensor:
    """vLLM's TP collective through torch.distributed's default group; identity on a single rank."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return cache
    if not gather:
        dist.all_reduce(cache)
        return cache
    parts = [torch.empty_like(cache) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, cache.contiguous())
    return torch.cat(parts, dim=-1)


def _join(call: OpCall, cache: torch.Tensor, collective: Callable | None) -> torch.Tensor:
    """Apply the fully-sharded collective (w13 gather when B's rank dim differs from R, else w2 reduce)."""
    gather = call.rank_b != call.rank
    joined = collective(cache) if collective is not None else _default_collective(cache, gather)
    if not isinstance(joined, torch.Tensor) or joined.dtype != cache.dtype or joined.device != cache.device:
        raise TypeError(f"collective must return a {cache.dtype} tensor on {cache.device}; got {type(joined).__name__}")
    want = (*cache.shape[:3], call.rank_b)
    if tuple(joined.shape) != want:
        how = "all_gather over the rank dim" if gather else "all_reduce"
        raise MoELoRAArgumentError(
            f"fully_sharded: the joined rank cache must have shape {want} to match lora_b_stacked's rank dim "
            f"{call.rank_b}; got {tuple(joined.shape)} (expected {how}; is a process group or collective= set?)"
        )
    return joined.contiguous()


def run_two_kernel(call: OpCall, collective: Callable | None = None, sub_m: int | None = None) -> None:
    """Shrink, (join across ranks when fully_sharded,) expand, for a validated call of any rank."""
    P = call.num_pairs
    n_lora = 1 if call.naive else call.num_active
    if P == 0 or (not call.naive and call.em == 0):
        return
    if n_lora == 0 and not call.fully_sharded:
        return
    out, x = call.output, call.x
    if call.naive:
        sub_m = 16
    elif sub_m is None:
        sub_m = choose_sub_m(call)
    m_programs = P if call.naive else triton.cdiv(call.em, sub_m)
    sorted_ids = call.expert_ids if call.naive else call.sorted_token_ids
    ntpp = call.expert_ids if call.naive else call.num_tokens_post_padded
    stride_sl = 0 if call.naive else call.sorted_token_ids.stride(0)
    stride_el = 0 if call.naive else call.expert_ids.stride(0)
    ieee = out.dtype == torch.float32
    common = dict(NAIVE=call.naive, BLOCK_M=call.block_m if not call.naive else 16, SUB_M=sub_m, IEEE=ieee)

    cache = torch.zeros((call.num_slices, call.num_tokens, call.top_k, call.rank), dtype=out.dtype, device=out.device)
    A0 = call.lora_a[0]
    block_r = min(64, max(16, next_pow2(call.rank)))
    r_tiles = triton.cdiv(call.rank, block_r)
    block_k = block_k_for(call.hidden)
    stride_ae = 0 if call.experts_a == 1 else A0.stride(1)
    for first, count in slice_pairs(call.num_slices) if n_lora else []:
        args = (
            x, call.lora_a[first], call.lora_a[first + count - 1], cache, sorted_ids, call.expert_ids, ntpp,
            call.token_lora_mapping, call.lora_ids, call.adapter_enabled,
            call.hidden, call.rank, P, call.top_k, call.max_loras, call.em, r_tiles, first,
            x.stride(0), x.stride(1), A0.stride(0), stride_ae, A0.stride(2), A0.stride(3),
            cache.stride(0), cache.stride(2), cache.stride(3), stride_sl, stride_el,
        )
        meta = dict(common, X_ROW_DIV=call.x_row_div, BLOCK_R=block_r, BLOCK_K=block_k,
                    EVEN_K=call.hidden % block_k == 0)
        launch(_shrink_kernel, (m_programs * r_tiles, count, n_lora), args, meta, 4, 3,
               ("shrink", out.dtype, tuple(sorted(meta.items()))))

    if call.fully_sharded:
        cache = _join(call, cache, collective)
    if n_lora == 0:
        return
    B0 = call.lora_b[0]
    R = cache.shape[-1]
    block_n = 128 if call.n_out >= 128 else max(16, next_pow2(call.n_out))
    n_tiles = triton.cdiv(call.n_out, block_n)
    block_kr = min(64, max(16, next_pow2(R)))
    stride_be = 0 if call.experts_b == 1 else B0.stride(1)
    for first, count in slice_pairs(call.num_slices):
        args = (
            cache, call.lora_b[first], call.lora_b[first + count - 1], out, call.weights, sorted_ids, call.expert_ids,
            ntpp, call.token_lora_mapping, call.lora_ids, call.adapter_enabled,
            call.n_out, R, P, call.top_k, call.max_loras, call.em, n_tiles, first, call.offset + first * call.n_out,
            cache.stride(0), cache.stride(2), cache.stride(3), B0.stride(0), stride_be, B0.stride(2), B0.stride(3),
            out.stride(1), out.stride(2), stride_sl, stride_el,
        )
        meta = dict(common, MUL_W=call.mul_routed_weight, ADD_INPUTS=call.add_inputs, BLOCK_N=block_n,
                    BLOCK_KR=block_kr)
        launch(_expand_kernel, (m_programs * n_tiles, count, n_lora), args, meta, 4, 3,
               ("expand", out.dtype, tuple(sorted(meta.items()))))
