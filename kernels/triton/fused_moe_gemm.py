"""Fused-MoE grouped GEMM over aligned expert blocks (spec 5): out[p] = rnd(w_p * (x[row(p)] @ W[e]^T + b[e])).

One program owns one align block (BLOCK_M rows of one expert) x one BLOCK_N column tile, walks K in
BLOCK_K steps with fp32 accumulation (tl.dot; input_precision="ieee" for fp32), adds the bias in fp32,
multiplies by the fp32 routing weight, then rounds once to dt. Programs are ordered in groups of
GROUP_M block rows so consecutive programs reuse the same weight columns from L2.
The same kernel serves the OAI-style grouped GEMM (rows addressed through a permutation) and the
Marlin-style weight-only quantized GEMM (int4/int8 tiles dequantized in the K loop, see quant_gemm).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_lora_harness.kernels.dtypes import FLOAT_DTYPES
from moe_lora_harness.kernels.fp8_schemes import FP8_BLOCK_K
from moe_lora_harness.kernels.triton.launch import launch, next_pow2
from moe_lora_harness.kernels.triton.platform import device_info
from moe_lora_harness.kernels.triton.quant_gemm import FP8_SCHEMES, check_quant, load_weight_tile
from moe_lora_harness.kernels.validate import checks_enabled, UNCHECKED_ENV


FP8_BLOCKS = {code: block for block, code in FP8_SCHEMES.values()}   # QUANT code of an FP8 scheme -> its block
FP8_CODES = tuple(sorted(FP8_BLOCKS))                                # QUANT codes whose activations are e4m3


@triton.jit
def _moe_gemm_kernel(
    out_ptr, x_ptr, w_ptr, s_ptr, xs_ptr, bias_ptr, tw_ptr, ids_ptr, expert_ids_ptr, ntpp_ptr, perm_ptr,
    N, K, EM, num_rows,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sg, stride_xsm, stride_xsg,
    stride_be, stride_bn, stride_om, stride_on,
    X_ROW_DIV: tl.constexpr, USE_PERM: tl.constexpr, X_BY_SLOT: tl.constexpr, HAS_BIAS: tl.constexpr,
    MUL_W: tl.constexpr, QUANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
):
    """Grid (cdiv(EM, BLOCK_M) * cdiv(N, BLOCK_N),). ids (EM,) are out rows, padded with num_rows.

    pair = perm[id] if USE_PERM else id (routing weight index); x row = id if X_BY_SLOT else pair // X_ROW_DIV.
    QUANT 3/4 (FP8): x holds e4m3 codes with fp32 scales xs (per row / per row and 128-group), w e4m3 codes with
    per-channel / 128x128-block scales s; each K tile's e4m3 dot is added to the fp32 accumulator on its own (the
    tensor cores' reduced-precision accumulation spans one tile at most), block scales applied per tile.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(EM, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows
    if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(ids_ptr + offs_m, mask=offs_m < EM, other=num_rows).to(tl.int64)
    row_mask = ids < num_rows
    ids = tl.where(row_mask, ids, 0)
    if USE_PERM:
        pair = tl.load(perm_ptr + ids, mask=row_mask, other=0).to(tl.int64)
    else:
        pair = ids
    if X_BY_SLOT:
        x_rows = ids
    else:
        x_rows = pair // X_ROW_DIV

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_wn = offs_n % N  # wrapped columns are computed and never stored: no N mask on weight loads
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k < K - k0
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
        else:
            a = tl.load(x_ptrs, mask=row_mask[:, None] & kmask[None, :], other=0.0)
        b = load_weight_tile(w_ptr, s_ptr, expert, offs_k, offs_wn, k0, kmask, K, stride_we, stride_wn, stride_wk,
                             stride_se, stride_sn, stride_sg, dt, QUANT, EVEN_K, BLOCK_K)
        if QUANT >= 3:   # e4m3 codes travel as bytes (a masked fp8 load's zero is not castable in the interpreter)
            a = a.to(tl.float8e4nv, bitcast=True)
            b = b.to(tl.float8e4nv, bitcast=True)
        if QUANT == 4:
            kb = k0 // 128
            xs = tl.load(xs_ptr + x_rows * stride_xsm + kb * stride_xsg, mask=row_mask, other=0.0)
            ws = tl.load(s_ptr + expert * stride_se + (offs_wn // 128) * stride_sn + kb * stride_sg)
            acc += tl.dot(a, b) * xs[:, None] * ws[None, :]
        elif QUANT == 3:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K * stride_xk
    if QUANT == 3:
        xs = tl.load(xs_ptr + x_rows * stride_xsm, mask=row_mask, other=0.0)
        ws = tl.load(s_ptr + expert * stride_se + offs_wn * stride_sn)
        acc = acc * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_be + offs_wn * stride_bn).to(tl.float32)
        acc = acc + bias[None, :]
    if MUL_W:
        wv = tl.load(tw_ptr + pair, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * wv[:, None]
    out_ptrs = out_ptr + ids[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(dt), mask=row_mask[:, None] & (offs_n < N)[None, :])


@dataclass(frozen=True)
class GemmConfig:
    """Launch tiles of the grouped GEMM besides BLOCK_M (= the align block size)."""

    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def choose_block_m(num_pairs: int, num_experts: int, fp8: bool = False) -> int:
    """Align block size by the expected rows per expert: 16 for decode-like batches up to 128 for prefill; at most
    64 for FP8 GEMMs (H200 sweep, bench/tune_fp8_gemm.py: 64-row e4m3 tiles beat 128-row ones at 4096 tokens by
    1.1-1.6x, bench/results/2026-12-02-h200-s14/tune)."""
    per_expert = num_pairs / max(1, num_experts)
    for bm, limit in ((16, 16), (32, 32), (64, 96)):
        if per_expert <= limit:
            return bm
    return 64 if fp8 else 128


def choose_config(block_m: int, N: int, K: int, dtype: torch.dtype, device, quant_code: int = 0) -> GemmConfig:
    """sm_90-minded tiles: BLOCK_N 64 (small M, more programs) or 128, BLOCK_K 64 (128 for thin M and for e4m3),
    3-4 stages."""
    info = device_info(device)
    block_n = 64 if block_m <= 32 or N <= 64 else 128
    block_k = 128 if block_m <= 32 and K >= 128 else 64
    if dtype == torch.float32:
        block_k = 32
    block_n = min(block_n, max(16, next_pow2(N)))
    block_k = min(block_k, max(16, next_pow2(K)))
    esz = torch.empty((), dtype=dtype).element_size()
    if quant_code == 1:
        block_k = min(block_k, 128)  # a K tile must stay inside one 128-wide scale group
    fp8 = quant_code in FP8_CODES
    if fp8:   # e4m3 operands: K tiles of 128 (one scale block; e4m3 MMAs take K in 32s)
        block_k, esz = (FP8_BLOCK_K if K >= FP8_BLOCK_K else max(32, next_pow2(K))), 1
    stages = 3 if fp8 else (4 if block_m <= 64 else 3)   # FP8: 3 stages and 4 warps won the H200 sweep
    while stages > 2 and stages * (block_m * block_k + block_k * block_n) * esz > 0.8 * info.max_shared_mem:
        stages -= 1
    warps = 8 if block_m * block_n >= 128 * 128 and not fp8 else 4
    return GemmConfig(block_n=block_n, block_k=block_k, group_m=8, num_warps=warps, num_stages=stages)


def _tensor(t, arg: str, dims: int, expect: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor {expect}; got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{arg} must be {dims}-D {expect}; got shape {tuple(t.shape)}")
    return t


def _int(v, arg: str, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{arg} must be an int >= {minimum}; got {v!r}")
    return v


def check_block_m(block_m) -> int:
    """block_m must be a power of two >= 16 (tl.dot tiles); it must equal the align block size."""
    bm = _int(block_m, "block_m")
    if bm < 16 or bm & (bm - 1):
        raise ValueError(f"block_m must be a power of two >= 16 and equal the align block size; got {bm}")
    return bm


def check_weights(w, quant, bias, dt: torch.dtype, dev: torch.device):
    """(E, N, K, quant code) of the dense `w` (E, N, K) dt or of `quant` (exactly one given), bias (E, N) dt."""
    if quant is not None:
        if w is not None:
            raise ValueError("give either w (dense) or quant (QuantWeights replacing w), not both")
        qw = check_quant(quant, dt, dev)
        E, N, K, code = qw.num_experts, qw.N, qw.K, qw.code
    else:
        _tensor(w, "w", 3, "(E, N, K)")
        if w.dtype != dt:
            raise TypeError(f"w must have the output's dtype {dt}; got {w.dtype}")
        if w.device != dev:
            raise ValueError(f"w is on {w.device}; it must be on the output's device {dev}")
        E, N, K = (int(s) for s in w.shape)
        code = 0
    if min(E, N, K) < 1:
        raise ValueError(f"weights must have non-empty (E, N, K); got ({E}, {N}, {K})")
    if bias is not None:
        _tensor(bias, "bias", 2, "(E, N)")
        if tuple(bias.shape) != (E, N) or bias.dtype != dt or bias.device != dev:
            raise ValueError(f"bias must be a ({E}, {N}) {dt} tensor on {dev}; got {bias.dtype} {tuple(bias.shape)} "
                             f"on {bias.device}")
    return E, N, K, code


def routing_weights(topk_weights, mul_routed_weight: bool, num_pairs: int, dev) -> torch.Tensor | None:
    """Flat fp32 (T*k,) routing weights when mul_routed_weight (required then), else None."""
    if not isinstance(mul_routed_weight, bool):
        raise TypeError(f"mul_routed_weight must be a bool; got {mul_routed_weight!r}")
    if not mul_routed_weight:
        return None
    if topk_weights is None:
        raise ValueError("topk_weights (T, k) float must be given when mul_routed_weight=True")
    _tensor(topk_weights, "topk_weights", 2, "(T, k) float")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be a floating-point tensor (promoted to fp32); got {topk_weights.dtype}")
    if topk_weights.numel() != num_pairs or topk_weights.device != dev:
        raise ValueError(f"topk_weights must hold T*k = {num_pairs} weights on {dev}; got shape "
                         f"{tuple(topk_weights.shape)} on {topk_weights.device}")
    return topk_weights.reshape(-1).to(torch.float32).contiguous()


def _id_vec(t, arg: str, dev) -> torch.Tensor:
    _tensor(t, arg, 1, "int32")
    if t.dtype != torch.int32:
        raise TypeError(f"{arg} must be int32; got {t.dtype}")
    if t.device != dev:
        raise ValueError(f"{arg} is on {t.device}; it must be on the output's device {dev}")
    return t.contiguous()


def check_block_values(ids, expert_ids, ntpp, num_rows: int, E: int, block_m: int, arg: str) -> None:
    """One fused device check (a single sync; skipped under CUDA-graph capture or MOE_LORA_UNCHECKED=1):
    ntpp in [0, EM], ids in [0, num_rows] and expert ids in [-1, E) in the blocks below ntpp."""
    if ids.numel() == 0 or not checks_enabled(ids.device):
        return
    EM = ids.numel()
    n = ntpp.reshape(-1)[0].long()
    live = torch.arange(EM, device=ids.device) < n
    live_blk = torch.arange(expert_ids.numel(), device=ids.device) * block_m < n
    bad_n = (n < 0) | (n > EM)
    bad_ids = (live & ((ids < 0) | (ids > num_rows))).any()
    bad_e = (live_blk & ((expert_ids < -1) | (expert_ids >= E))).any()
    flags = torch.stack([bad_n, bad_ids, bad_e]).tolist()
    msgs = [f"num_tokens_post_padded must be in [0, {EM}]",
            f"{arg} must hold row ids in [0, {num_rows}] (pad = {num_rows}) below num_tokens_post_padded",
            f"expert_ids must hold local expert ids in [-1, {E}) below num_tokens_post_padded"]
    failed = [m for m, f in zip(msgs, flags) if f]
    if failed:
        raise ValueError("; ".join(failed) + f" (set {UNCHECKED_ENV}=1 to skip this check)")


def check_x_scales(x, x_scales, code: int, dt: torch.dtype, dev) -> None:
    """FP8 codes (QUANT 3/4): x float8_e4m3fn with fp32 x_scales (rows, 1) or (rows, K/128), out in 16 bits;
    other codes: x in the output's dtype and no x_scales."""
    if code not in FP8_CODES:
        if x_scales is not None:
            raise ValueError("x_scales is for FP8 weights only (quant with an fp8 scheme); got a tensor")
        if x.dtype != dt or x.device != dev:
            raise TypeError(f"x must be {dt} on {dev} like out; got {x.dtype} on {x.device}")
        return
    if dt not in (torch.float16, torch.bfloat16):
        raise TypeError(f"FP8 weights need out in float16 or bfloat16; got {dt}")
    if x.dtype != torch.float8_e4m3fn or x.device != dev:
        raise TypeError(f"x must hold float8_e4m3fn codes on {dev} for FP8 weights (kernels.triton.fp8_quant); got "
                        f"{x.dtype} on {x.device}")
    block = FP8_BLOCKS[code]
    groups = 1 if block is None else int(x.shape[1]) // block
    if (not isinstance(x_scales, torch.Tensor) or x_scales.dtype != torch.float32 or x_scales.device != dev
            or tuple(x_scales.shape) != (int(x.shape[0]), groups)):
        raise ValueError(f"x_scales must be a float32 tensor {(int(x.shape[0]), groups)} on {dev} (x's scales per "
                         f"{'row' if groups == 1 else 'row and 128 columns'}); got "
                         f"{getattr(x_scales, 'dtype', type(x_scales).__name__)} {tuple(getattr(x_scales, 'shape', ()))}")


def launch_gemm(out, x, w_or_q, bias, tw, ids, expert_ids, ntpp, perm, *, K, num_rows, x_row_div, use_perm,
                x_by_slot, block_m, code, config: GemmConfig | None, x_scales=None) -> None:
    """Launch the grouped GEMM kernel on validated arguments (shared by fused_moe_gemm and grouped_gemm)."""
    EM = ids.numel()
    N = out.shape[1]
    if EM == 0 or num_rows == 0:
        return
    dt = out.dtype
    cfg = config or choose_config(block_m, N, K, dt, out.device, code)
    if code == 1 and 128 % cfg.block_k:
        raise ValueError(f"int4_g128 needs a BLOCK_K dividing 128; got {cfg.block_k}")
    if code in FP8_CODES:                 # the kernel reads e4m3 codes as bytes and bitcasts them
        x = x.view(torch.uint8)
    if code:
        wt, st = w_or_q.packed, w_or_q.scales
        wt = wt.view(torch.uint8) if code in FP8_CODES else wt
        sw = (wt.stride(0), wt.stride(1), wt.stride(2))
        ss = (st.stride(0), st.stride(1), st.stride(2) if st.dim() == 3 else 0)
    else:
        wt = st = w_or_q
        sw = (wt.stride(0), wt.stride(1), wt.stride(2))
        ss = (0, 0, 0)
    b = bias if bias is not None else out
    sb = (bias.stride(0), bias.stride(1)) if bias is not None else (0, 0)
    grid = (triton.cdiv(EM, block_m) * triton.cdiv(N, cfg.block_n),)
    xs = x_scales if x_scales is not None else out
    sxs = (x_scales.stride(0), x_scales.stride(1)) if x_scales is not None else (0, 0)
    args = (out, x, wt, st, xs, b, tw if tw is not None else out, ids, expert_ids, ntpp,
            perm if perm is not None else ids, N, K, EM, num_rows, x.stride(0), x.stride(1), *sw, *ss, *sxs, *sb,
            out.stride(0), out.stride(1))
    meta = dict(X_ROW_DIV=x_row_div, USE_PERM=use_perm, X_BY_SLOT=x_by_slot, HAS_BIAS=bias is not None,
                MUL_W=tw is not None, QUANT=code, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                GROUP_M=cfg.group_m, EVEN_K=K % cfg.block_k == 0, IEEE=dt == torch.float32)
    key = ("moe_gemm", dt, tuple(sorted(meta.items())), cfg.num_warps)
    launch(_moe_gemm_kernel, grid, args, meta, cfg.num_warps, cfg.num_stages, key)


def fused_moe_gemm(out, x, w, sorted_token_ids, expert_ids, num_tokens_post_padded, *, top_k, x_row_div,
                   topk_weights=None, mul_routed_weight=False, bias=None, block_m=64, quant=None,
                   config: GemmConfig | None = None, x_scales=None) -> None:
    """In place: out[p] = rnd(w_p * (x[p // x_row_div] @ W[e]^T + bias[e])) for every pair p in the align.

    out (T*k, N) dt; x (T, K) with x_row_div = top_k or (T*k, K) with x_row_div = 1; w (E, N, K) dt or
    quant=QuantWeights (then w=None); ids from moe_align_block_size(block_size=block_m). The weight
    w_p (fp32) applies only with mul_routed_weight. Rows of pairs not in the align are not written.
    FP8 quant: x holds e4m3 codes and x_scales their fp32 scales (kernels.triton.fp8_quant.quantize_activation).
    """
    _tensor(out, "out", 2, "(T*k, N)")
    if out.dtype not in FLOAT_DTYPES:
        raise TypeError(f"out must be float16, bfloat16 or float32; got {out.dtype}")
    dt, dev = out.dtype, out.device
    _tensor(x, "x", 2, "(T, K) or (T*k, K)")
    E, N, K, code = check_weights(w, quant, bias, dt, dev)
    check_x_scales(x, x_scales, code, dt, dev)
    k = _int(top_k, "top_k")
    P = int(out.shape[0])
    if P % k:
        raise ValueError(f"out.shape[0] must be T*k, a multiple of top_k={k}; got {P}")
    if out.shape[1] != N:
        raise ValueError(f"out must have shape (T*k, N) with N={N} (from the weights); got {tuple(out.shape)}")
    if isinstance(x_row_div, bool) or x_row_div not in (1, k):
        raise ValueError(f"x_row_div must be top_k={k} (x is (T, K)) or 1 (x is (T*k, K)); got {x_row_div!r}")
    if tuple(x.shape) != (P // x_row_div, K):
        raise ValueError(f"x must have shape (T*k/x_row_div, K) = {(P // x_row_div, K)}; got {tuple(x.shape)}")
    bm = check_block_m(block_m)
    tw = routing_weights(topk_weights, mul_routed_weight, P, dev)
    ids = _id_vec(sorted_token_ids, "sorted_token_ids", dev)
    eids = _id_vec(expert_ids, "expert_ids", dev)
    ntpp = _id_vec(num_tokens_post_padded.reshape(-1) if isinstance(num_tokens_post_padded, torch.Tensor)
                   else num_tokens_post_padded, "num_tokens_post_padded", dev)
    if ntpp.numel() != 1:
        raise ValueError(f"num_tokens_post_padded must hold one int32; got shape {tuple(num_tokens_post_padded.shape)}")
    if eids.numel() != triton.cdiv(ids.numel(), bm):
        raise ValueError(f"expert_ids must have cdiv(EM, block_m) = {triton.cdiv(ids.numel(), bm)} entries "
                         f"(EM = sorted_token_ids.numel() = {ids.numel()}, block_m = {bm}); got {eids.numel()} "
                         "(is block_m the align block size?)")
    check_block_values(ids, eids, ntpp, P, E, bm, "sorted_token_ids")
    launch_gemm(out, x, quant if code else w, bias, tw, ids, eids, ntpp, None, K=K, num_rows=P, x_row_div=x_row_div,
                use_perm=False, x_by_slot=False, block_m=bm, code=code, config=config, x_scales=x_scales)
