"""moe_sum (spec 5): out[t] = rnd(sum_j fp32(cache3[t, j])), fp32 accumulation in slot order, one rounding.

Non-valid slots (non-local experts under EP) are skipped. The same kernel, reading each slot's row
through an index table, is the OAI-style scatter-sum (grouped_gemm.scatter_sum), so both layouts give
bit-identical sums. Summation order: slots j = 0..k-1 added to a 0.0 fp32 accumulator.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_lora_harness.kernels.dtypes import FLOAT_DTYPES
from moe_lora_harness.kernels.triton.launch import next_pow2


@triton.jit
def _sum_pairs_kernel(out_ptr, src_ptr, idx_ptr, valid_ptr, H, stride_ot, stride_oh, stride_st, stride_sj,
                      stride_sh, TOP_K: tl.constexpr, INDIRECT: tl.constexpr, HAS_VALID: tl.constexpr,
                      BLOCK_H: tl.constexpr):
    """Grid (T, cdiv(H, BLOCK_H)). INDIRECT: slot (t, j) is src row idx[t*k + j] (-1 = skipped)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        if INDIRECT:
            row = tl.load(idx_ptr + t * TOP_K + j).to(tl.int64) + tl.zeros((BLOCK_H,), dtype=tl.int64)
            ok = row >= 0
            v = tl.load(src_ptr + tl.maximum(row, 0) * stride_st + offs * stride_sh, mask=hmask & ok, other=0.0)
            acc = tl.where(ok, acc + v.to(tl.float32), acc)  # skipped: acc bit-identical (no +0.0 sign change)
        elif HAS_VALID:
            ok = (tl.load(valid_ptr + t * TOP_K + j) + tl.zeros((BLOCK_H,), dtype=tl.int8)) != 0
            v = tl.load(src_ptr + t * stride_st + j * stride_sj + offs * stride_sh, mask=hmask & ok, other=0.0)
            acc = tl.where(ok, acc + v.to(tl.float32), acc)
        else:
            v = tl.load(src_ptr + t * stride_st + j * stride_sj + offs * stride_sh, mask=hmask, other=0.0)
            acc = acc + v.to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=hmask)


def launch_sum(out, src, idx, valid, top_k: int, src_strides: tuple) -> None:
    """Launch the pair-sum kernel on validated arguments (shared with scatter_sum)."""
    T, H = out.shape
    if T == 0 or H == 0:
        return
    block_h = min(1024, max(16, next_pow2(H)))
    grid = (T, triton.cdiv(H, block_h))
    dummy = out
    _sum_pairs_kernel[grid](
        out, src, idx if idx is not None else dummy, valid if valid is not None else dummy, H,
        out.stride(0), out.stride(1), *src_strides,
        TOP_K=top_k, INDIRECT=idx is not None, HAS_VALID=valid is not None, BLOCK_H=block_h,
        num_warps=4 if block_h >= 512 else 2,
    )


def check_out(out, T: int, H: int, dt: torch.dtype, dev) -> None:
    """out must be a (T, H) tensor of dtype dt on dev."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor (T, H); got {type(out).__name__}")
    if out.dim() != 2 or tuple(out.shape) != (T, H):
        raise ValueError(f"out must have shape (T, H) = {(T, H)}; got {tuple(out.shape)}")
    if out.dtype != dt or out.device != dev:
        raise TypeError(f"out must be {dt} on {dev}; got {out.dtype} on {out.device}")


def moe_sum(cache3, out, valid=None) -> None:
    """In place: out[t] = rnd(sum over valid slots j of fp32(cache3[t, j])); a token with none gets 0.

    cache3 (T, k, H) dt; out (T, H) dt; valid (T, k) bool or None (every slot counts).
    """
    if not isinstance(cache3, torch.Tensor):
        raise TypeError(f"cache3 must be a torch.Tensor (T, k, H); got {type(cache3).__name__}")
    if cache3.dim() != 3 or cache3.shape[1] < 1:
        raise ValueError(f"cache3 must have shape (T, k, H) with k >= 1; got {tuple(cache3.shape)}")
    if cache3.dtype not in FLOAT_DTYPES:
        raise TypeError(f"cache3 must be float16, bfloat16 or float32; got {cache3.dtype}")
    T, k, H = (int(s) for s in cache3.shape)
    check_out(out, T, H, cache3.dtype, cache3.device)
    v = None
    if valid is not None:
        if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool:
            raise TypeError(f"valid must be a bool torch.Tensor (T, k); got {getattr(valid, 'dtype', type(valid).__name__)}")
        if tuple(valid.shape) != (T, k) or valid.device != cache3.device:
            raise ValueError(f"valid must have shape (T, k) = {(T, k)} on {cache3.device}; got {tuple(valid.shape)} "
                             f"on {valid.device}")
        v = valid.to(torch.int8).contiguous()
    launch_sum(out, cache3, None, v, k, (cache3.stride(0), cache3.stride(1), cache3.stride(2)))
