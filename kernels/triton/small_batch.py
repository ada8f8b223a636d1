"""Small-batch MoE-LoRA kernel (naive layout, rank <= 64, T*k*rank <= 1024): GEMV style, fp32 throughout.

Numerics (vLLM 0.33.0 small-batch, spec 1.5): u = sum_K fp32(A) fp32(x) is NOT rounded; d = sum_R
fp32(B) u, times fp32 routing weight; a single rounding: out = rnd(fp32(prev) + d) (or rnd(d)).
A program owns one pair, one slice and a chunk of N columns; no tensor cores (tl.sum reductions).
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from moe_lora_harness.kernels.triton.launch import CostModel, launch, next_pow2, slice_pairs
from moe_lora_harness.op_contract.call import MoELoRAArgumentError, OpCall
from moe_lora_harness.kernels.triton.platform import device_info

MAX_RANK = 64
MAX_PAIRS_X_RANK = 1024


def small_batch_unsupported(naive: bool, rank: int, num_pairs: int, fully_sharded: bool) -> str | None:
    """Why the small-batch path cannot take a call (None if it can)."""
    if fully_sharded:
        return "small-batch cannot run fully_sharded (it has no collective between shrink and expand)"
    if not naive:
        return "small-batch needs the naive layout (sorted_token_ids=None)"
    if rank > MAX_RANK:
        return f"small-batch needs max_lora_rank <= {MAX_RANK}; got {rank}"
    if num_pairs * rank > MAX_PAIRS_X_RANK:
        return f"small-batch needs T*k*rank <= {MAX_PAIRS_X_RANK}; got {num_pairs}*{rank} = {num_pairs * rank}"
    return None


@triton.jit
def _small_batch_kernel(
    x_ptr, a0_ptr, a1_ptr, b0_ptr, b1_ptr, out_ptr, w_ptr, expert_ptr, map_ptr, enabled_ptr,
    N, K, top_k, max_loras, col0, n_chunks, n_per_prog,
    stride_xm, stride_xk, stride_al, stride_ae, stride_ar, stride_ak,
    stride_bl, stride_be, stride_bn, stride_br, stride_om, stride_on,
    X_ROW_DIV: tl.constexpr, MUL_W: tl.constexpr, ADD_INPUTS: tl.constexpr,
    BLOCK_R: tl.constexpr, RANK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Grid (pairs * n_chunks, slices in this launch (1 or 2))."""
    pid0 = tl.program_id(0)
    pid_s = tl.program_id(1)
    pair = pid0 // n_chunks
    chunk = pid0 % n_chunks
    lora = tl.load(map_ptr + pair // top_k)
    in_range = (lora >= 0) & (lora < max_loras)
    lora = tl.where(in_range, lora, 0).to(tl.int64)
    expert = tl.load(expert_ptr + pair)
    valid = in_range & (expert >= 0)
    valid = valid & (tl.load(enabled_ptr + lora) != 0)
    if valid == 0:
        return
    expert = expert.to(tl.int64)
    a_ptr = a0_ptr
    b_ptr = b0_ptr
    col = col0
    if pid_s == 1:
        a_ptr = a1_ptr
        b_ptr = b1_ptr
        col = col0 + N

    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < RANK  # offsets unclamped (masked): a clamp hides B's rank contiguity from the compiler
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + (pair // X_ROW_DIV).to(tl.int64) * stride_xm
    a_base = a_ptr + lora * stride_al + expert * stride_ae + offs_r[:, None] * stride_ar
    u = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        if EVEN_K:
            xt = tl.load(x_row + ks * stride_xk).to(tl.float32)
            at = tl.load(a_base + ks[None, :] * stride_ak, mask=rmask[:, None], other=0.0).to(tl.float32)
        else:
            kmask = ks < K
            xt = tl.load(x_row + ks * stride_xk, mask=kmask, other=0.0).to(tl.float32)
            at = tl.load(a_base + ks[None, :] * stride_ak, mask=rmask[:, None] & kmask[None, :],
                         other=0.0).to(tl.float32)
        u += tl.sum(at * xt[None, :], axis=1)

    if MUL_W:
        w = tl.load(w_ptr + pair).to(tl.float32)
    n_lo = chunk * n_per_prog
    n_hi = tl.minimum(n_lo + n_per_prog, N)
    offs_n = tl.arange(0, BLOCK_N)
    b_base = b_ptr + lora * stride_bl + expert * stride_be + offs_r[None, :] * stride_br
    out_row = out_ptr + pair.to(tl.int64) * stride_om
    for n0 in range(n_lo, n_hi, BLOCK_N):
        cols = n0 + offs_n
        nmask = cols < n_hi
        bt = tl.load(b_base + cols[:, None] * stride_bn, mask=nmask[:, None] & rmask[None, :], other=0.0)
        d = tl.sum(bt.to(tl.float32) * u[None, :], axis=1)
        if MUL_W:
            d = d * w
        optrs = out_row + (col + cols) * stride_on
        if ADD_INPUTS:
            d = tl.load(optrs, mask=nmask, other=0.0).to(tl.float32) + d
        tl.store(optrs, d.to(out_ptr.dtype.element_ty), mask=nmask)


@dataclass(frozen=True)
class SmallBatchConfig:
    """Launch parameters of the small-batch kernel."""

    block_n: int
    block_k: int
    n_chunks: int  # programs splitting one (pair, slice)'s N columns (each recomputes the rank vector)
    num_warps: int
    num_stages: int = 2


# The N-chunk cost model's constants, fit to this kernel's H200 sweeps (first session). Its own: the one-shot
# kernel's refit (SLOTS 6, L2 6e12) made mixtral's small-batch shapes up to 40% slower when shared.
SMALL_BATCH_COST = CostModel(program_bw=20e9, slots_per_sm=3, l2_bw=4e12)


def _pick_chunks(call: OpCall, block_n: int, sm: int) -> int:
    """N chunks per (pair, slice): twice the cost model's split (H200 sweeps favour more)."""
    esz = call.output.element_size()
    shrink = (call.rank + 1) * call.hidden * esz
    expand = call.n_out * (call.rank + 2) * esz
    tiles = triton.cdiv(call.n_out, block_n)
    pair_slices = max(1, call.num_pairs * min(2, call.num_slices))
    best = (float("inf"), 1)
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        if n > tiles:
            break
        t = SMALL_BATCH_COST.time(shrink, expand, n, pair_slices * n, sm)
        if t < best[0]:
            best = (t, n)
    return min(tiles, 2 * best[1])


def choose_config(call: OpCall) -> SmallBatchConfig:
    """Heuristic (H200 sweeps): wide K tiles for many loads in flight, more warps for rank 64."""
    info = device_info(call.output.device)
    block_r = max(16, next_pow2(call.rank))
    if block_r >= 64:  # rank 64: (64, 128) A tiles over 8 warps measured best
        block_n, block_k, warps = 128, 128, 8
    else:  # rank <= 16: wide K tiles (1024) measured best; rank 32 interpolated
        block_n, block_k, warps = 64, (1024 if block_r <= 16 else 256), 4
    block_n = min(block_n, max(16, next_pow2(call.n_out)))
    block_k = min(block_k, max(16, next_pow2(call.hidden)))
    return SmallBatchConfig(block_n, block_k, _pick_chunks(call, block_n, info.sm_count), warps)


def run_small_batch(call: OpCall, config: SmallBatchConfig | None = None) -> None:
    """Launch the small-batch kernel for a validated call (raises MoELoRAArgumentError if the path cannot take it)."""
    why = small_batch_unsupported(call.naive, call.rank, call.num_pairs, call.fully_sharded)
    if why:
        raise MoELoRAArgumentError(why)
    P = call.num_pairs
    if P == 0:
        return
    cfg = config or choose_config(call)
    block_r = max(16, next_pow2(call.rank))
    block_n, block_k = cfg.block_n, cfg.block_k
    tiles = triton.cdiv(call.n_out, block_n)
    n_per_prog = triton.cdiv(tiles, max(1, min(cfg.n_chunks, tiles))) * block_n
    n_chunks = triton.cdiv(call.n_out, n_per_prog)
    A0, B0, out, x = call.lora_a[0], call.lora_b[0], call.output, call.x
    stride_ae = 0 if call.experts_a == 1 else A0.stride(1)
    stride_be = 0 if call.experts_b == 1 else B0.stride(1)
    for first, count in slice_pairs(call.num_slices):
        grid = (P * n_chunks, count)
        args = (
            x, call.lora_a[first], call.lora_a[first + count - 1], call.lora_b[first], call.lora_b[first + count - 1],
            out, call.weights, call.expert_ids, call.token_lora_mapping, call.adapter_enabled,
            call.n_out, call.hidden, call.top_k, call.max_loras, call.offset + first * call.n_out, n_chunks, n_per_prog,
            x.stride(0), x.stride(1), A0.stride(0), stride_ae, A0.stride(2), A0.stride(3),
            B0.stride(0), stride_be, B0.stride(2), B0.stride(3), out.stride(1), out.stride(2),
        )
        meta = dict(
            X_ROW_DIV=call.x_row_div, MUL_W=call.mul_routed_weight, ADD_INPUTS=call.add_inputs,
            BLOCK_R=block_r, RANK=call.rank, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=call.hidden % block_k == 0,
        )
        launch(_small_batch_kernel, grid, args, meta, cfg.num_warps, cfg.num_stages,
               ("small_batch", out.dtype, tuple(sorted(meta.items())), cfg.num_warps))
