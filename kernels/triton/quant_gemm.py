"""Weight-only quantized expert weights for the Marlin-style GEMM: packing and the in-kernel dequant tile.

Schemes: "int4_g128" (symmetric int4 in [-8, 7], one scale per group of 128 along K) and
"int8_channel" (int8 in [-127, 127], one scale per output channel). The GEMM (fused_moe_gemm with
quant=QuantWeights) loads the packed ints, unpacks them and dequantizes IN the kernel:
w = rnd_dt(fp32(q) * fp32(scale)), one rounding, then tl.dot in dt with fp32 accumulation.
int4 packing: byte j of a row holds q[2j] + 8 in its low nibble and q[2j+1] + 8 in its high nibble.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_lora_harness.kernels.fp8_schemes import WEIGHT_BLOCKS

# scheme -> (qmin, qmax, group along K or None for per-channel, kernel QUANT code)
SCHEMES = {"int4_g128": (-8, 7, 128, 1), "int8_channel": (-127, 127, None, 2)}
# FP8 (e4m3 codes, fp32 scales; the activations are quantized too, kernels/triton/fp8_quant.py):
# scheme -> (weight scale block along N and K or None for per-channel (kernels.fp8_schemes), kernel QUANT code)
FP8_SCHEMES = {name: (WEIGHT_BLOCKS[name], code) for name, code in (("fp8_w8a8", 3), ("fp8_block", 4))}


@dataclass
class QuantWeights:
    """Packed quantized weights of E experts, logical shape (E, N, K) like the dense `w`.

    packed: int4_g128 -> uint8 (E, N, K/2); int8_channel -> int8 (E, N, K); FP8 -> float8_e4m3fn (E, N, K).
    scales: int4_g128 -> (E, N, K/128); int8_channel, fp8_w8a8 -> (E, N); fp8_block -> (E, N/128, K/128);
    any float dtype (read as fp32).
    """

    scheme: str
    packed: torch.Tensor
    scales: torch.Tensor
    N: int
    K: int

    @property
    def num_experts(self) -> int:
        """E, the number of (local) experts."""
        return int(self.packed.shape[0])

    @property
    def code(self) -> int:
        """The kernel's QUANT constexpr for this scheme (1 = int4 g128, 2 = int8 per channel, 3 = fp8 per channel,
        4 = fp8 128x128 blocks)."""
        return FP8_SCHEMES[self.scheme][1] if self.scheme in FP8_SCHEMES else SCHEMES[self.scheme][3]

    @property
    def device(self) -> torch.device:
        """Device of the packed weights."""
        return self.packed.device


def _scheme(scheme) -> tuple:
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {sorted([*SCHEMES, *FP8_SCHEMES])}; got {scheme!r}")
    return SCHEMES[scheme]


def fp8_scale_shape(scheme: str, E: int, N: int, K: int) -> tuple:
    """The weight scales' shape of an FP8 scheme: (E, N) per channel, (E, N/128, K/128) in blocks (N, K % 128 == 0:
    ValueError otherwise)."""
    block, _ = FP8_SCHEMES[scheme]
    if block is None:
        return (E, N)
    if N % block or K % block:
        raise ValueError(f"{scheme} needs the weights' N and K divisible by {block}; got N={N}, K={K}")
    return (E, N // block, K // block)


def _check_q_and_scales(q, scales, dtype: torch.dtype, scheme: str) -> tuple[int, int, int]:
    """(E, N, K) of q, a non-empty (E, N, K) `dtype` tensor, with floating-point scales on its device."""
    if not isinstance(q, torch.Tensor) or q.dtype != dtype:
        raise TypeError(f"q must be a {str(dtype).removeprefix('torch.')} torch.Tensor (E, N, K) for {scheme}; got "
                        f"{getattr(q, 'dtype', type(q).__name__)}")
    if q.dim() != 3 or min(q.shape) < 1:
        raise ValueError(f"q must have shape (E, N, K) with non-empty dims; got {tuple(q.shape)}")
    if not isinstance(scales, torch.Tensor) or not scales.is_floating_point():
        raise TypeError(f"scales must be a floating-point torch.Tensor; got {getattr(scales, 'dtype', type(scales).__name__)}")
    if scales.device != q.device:
        raise ValueError(f"scales is on {scales.device}; it must be on q's device {q.device}")
    return tuple(int(s) for s in q.shape)


def _check_fp8(q, scales, scheme: str) -> tuple[int, int, int]:
    """(E, N, K) of FP8 codes q and their scales, checked in dtype, shape and device (no value read)."""
    E, N, K = _check_q_and_scales(q, scales, torch.float8_e4m3fn, scheme)
    want = fp8_scale_shape(scheme, E, N, K)
    if tuple(scales.shape) != want:
        raise ValueError(f"scales for {scheme} must have shape {want}; got {tuple(scales.shape)}")
    return E, N, K


def _pack_fp8(q, scales, scheme: str) -> QuantWeights:
    E, N, K = _check_fp8(q, scales, scheme)
    if scales.numel() and not bool(((scales > 0) & torch.isfinite(scales)).all()):
        raise ValueError(f"scales for {scheme} must be finite and > 0")
    return QuantWeights(scheme=scheme, packed=q.contiguous(), scales=scales, N=N, K=K)


def pack_weights(q, scales, scheme: str) -> QuantWeights:
    """(q int8 (E, N, K) in the scheme's range, scales) -> QuantWeights; int4 two values a byte, lossless.

    Raises ValueError/TypeError naming the argument for a wrong dtype, shape or out-of-range value
    (one device->host sync to check the range; packing is a one-time weight preparation). FP8 schemes take
    float8_e4m3fn codes as they are.
    """
    if scheme in FP8_SCHEMES:
        return _pack_fp8(q, scales, scheme)
    qmin, qmax, group, _ = _scheme(scheme)
    E, N, K = _check_q_and_scales(q, scales, torch.int8, scheme)
    if group is None:
        want = (E, N)
    else:
        if K % group:
            raise ValueError(f"{scheme} needs K (q.shape[2]) divisible by {group}; got K={K}")
        want = (E, N, K // group)
    if tuple(scales.shape) != want:
        raise ValueError(f"scales for {scheme} must have shape {want}; got {tuple(scales.shape)}")
    if q.numel() and bool(((q < qmin) | (q > qmax)).any()):
        raise ValueError(f"q values must lie in [{qmin}, {qmax}] for {scheme}; got [{int(q.min())}, {int(q.max())}]")
    if group is None:
        packed = q.contiguous()
    else:
        u = (q.to(torch.int16) + 8).to(torch.uint8)
        packed = (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()
    return QuantWeights(scheme=scheme, packed=packed, scales=scales, N=N, K=K)


def unpack_weights(qw: QuantWeights) -> torch.Tensor:
    """The int8 values (E, N, K) held by `qw` (torch ops; the inverse of pack_weights); FP8: the e4m3 codes."""
    if qw.scheme in FP8_SCHEMES:
        return qw.packed.clone()
    _scheme(qw.scheme)
    if qw.scheme == "int8_channel":
        return qw.packed.clone()
    p = qw.packed.to(torch.int16)
    lo, hi = (p & 0xF) - 8, (p >> 4) - 8
    return torch.stack([lo, hi], dim=-1).reshape(*qw.packed.shape[:-1], -1).to(torch.int8)


def check_quant(qw, dtype: torch.dtype, device: torch.device) -> QuantWeights:
    """QuantWeights consistent with itself and usable by the GEMM (shapes, dtypes, device)."""
    if not isinstance(qw, QuantWeights):
        raise TypeError(f"quant must be a QuantWeights (from pack_weights) or None; got {type(qw).__name__}")
    if qw.scheme in FP8_SCHEMES:
        _check_fp8(qw.packed, qw.scales, qw.scheme)
        if qw.packed.device != device:
            raise ValueError(f"quant.packed is on {qw.packed.device}; it must be on the output's device {device}")
        return qw
    _, _, group, _ = _scheme(qw.scheme)
    E = qw.packed.shape[0] if qw.packed.dim() == 3 else -1
    packed_dt, packed_k = (torch.int8, qw.K) if group is None else (torch.uint8, qw.K // 2)
    if qw.packed.dtype != packed_dt or tuple(qw.packed.shape) != (E, qw.N, packed_k):
        raise ValueError(
            f"quant.packed for {qw.scheme} must be {packed_dt} (E, N, {'K' if group is None else 'K/2'}) = "
            f"(E, {qw.N}, {packed_k}); got {qw.packed.dtype} {tuple(qw.packed.shape)}"
        )
    want = (E, qw.N) if group is None else (E, qw.N, qw.K // group)
    if group is not None and qw.K % group:
        raise ValueError(f"quant.K must be divisible by {group} for {qw.scheme}; got {qw.K}")
    if not qw.scales.is_floating_point() or tuple(qw.scales.shape) != want:
        raise ValueError(f"quant.scales for {qw.scheme} must be a float tensor {want}; got "
                         f"{qw.scales.dtype} {tuple(qw.scales.shape)}")
    for arg, t in (("quant.packed", qw.packed), ("quant.scales", qw.scales)):
        if t.device != device:
            raise ValueError(f"{arg} is on {t.device}; it must be on the output's device {device}")
    return qw


@triton.jit
def load_weight_tile(w_ptr, s_ptr, expert, offs_k, offs_n, k0, kmask, K, stride_we, stride_wn, stride_wk,
                     stride_se, stride_sn, stride_sg, dt: tl.constexpr, QUANT: tl.constexpr,
                     EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The (BLOCK_K, BLOCK_N) tile W[expert, n, k0 + k]^T in dt; QUANT 1/2 dequantize fp32(q)*fp32(s) -> dt.

    int4: the (BLOCK_K/2, BLOCK_N) packed bytes are loaded contiguously along K (so the loads pipeline),
    split into low/high nibbles and interleaved back to K order (row 2j = low nibble of byte j).
    """
    e_off = expert * stride_we
    if QUANT == 1:
        offs_kh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        ptrs = w_ptr + e_off + offs_n[None, :] * stride_wn + offs_kh[:, None] * stride_wk
        if EVEN_K:
            raw = tl.load(ptrs)
        else:
            raw = tl.load(ptrs, mask=(offs_kh < K // 2)[:, None], other=0)
        lo = (raw & 0xF).to(tl.int32) - 8
        hi = (raw >> 4).to(tl.int32) - 8
        q = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_K, offs_n.shape[0]))
        s = tl.load(s_ptr + expert * stride_se + offs_n * stride_sn + (k0 // 128) * stride_sg)
        tile = (q.to(tl.float32) * s.to(tl.float32)[None, :]).to(dt)
    else:
        ptrs = w_ptr + e_off + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None] * stride_wk
        if EVEN_K:
            raw = tl.load(ptrs)
        else:
            raw = tl.load(ptrs, mask=kmask[:, None], other=0)
        if QUANT == 2:
            s = tl.load(s_ptr + expert * stride_se + offs_n * stride_sn)
            tile = (raw.to(tl.float32) * s.to(tl.float32)[None, :]).to(dt)
        else:
            tile = raw
    return tile
