"""Dynamic FP8 (e4m3) activation quantization for the FP8 experts (docs/semantics.md 9.1).

Per token row ("fp8_w8a8") or per (row, group of 128 along K) ("fp8_block"): scale = amax / 448 in fp32 (amax
floored), codes = e4m3(clamp(x / scale, +-448)). Both divisions round once to nearest (div_rn), the clamp comes
before the rounding (a conversion past 448 is not relied on). The rounding to nearest-even onto the e4m3 grid is
done in fp32 arithmetic (`round_to_e4m3_grid`), so the final conversion is exact: Triton's own fp32 -> e4m3
conversion is wrong in the CPU interpreter (the carry of a round-up across a power of two is lost: 124.3 -> 64,
triton PR 11897) and rounds twice (through fp16) on sm_89 (triton PR 11753).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_lora_harness.kernels.dtypes import FLOAT_DTYPES
from moe_lora_harness.kernels.fp8_schemes import ACTIVATION_GROUPS, AMAX_FLOOR, E4M3_MAX

_BLOCK = 128
_MAX = tl.constexpr(E4M3_MAX)          # a jitted function reads module globals only as constexprs
_FLOOR = tl.constexpr(AMAX_FLOOR)


@triton.jit
def round_to_e4m3_grid(v):
    """fp32 v with |v| <= 448 -> the nearest e4m3 value (ties to even, subnormal spacing 2^-9), in fp32: adding
    and subtracting 1.5 * 2^(e + 20), whose fp32 spacing is e4m3's 2^(e - 3) at v's exponent e (>= -6)."""
    e = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    magic = (((e + 147) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    return (v + magic) - magic


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, K, group, stride_xm, stride_qm, stride_sm, BLOCK: tl.constexpr):
    """Grid (M, G): program (m, g) quantizes columns [g * group, (g + 1) * group) of row m."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    start = g * group
    lanes = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, group, BLOCK):
        cols = start + k0 + lanes
        v = tl.load(x_ptr + row * stride_xm + cols, mask=k0 + lanes < group, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), _FLOOR), _MAX)
    tl.store(s_ptr + row * stride_sm + g, scale)
    for k0 in range(0, group, BLOCK):
        cols = start + k0 + lanes
        mask = k0 + lanes < group
        v = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -_MAX), _MAX)
        tl.store(q_ptr + row * stride_qm + cols, round_to_e4m3_grid(q).to(tl.float8e4nv), mask=mask)


def check_scheme(scheme) -> int | None:
    """The scheme's activation group (None: per row); ValueError naming `scheme` otherwise."""
    if scheme not in ACTIVATION_GROUPS:
        raise ValueError(f"scheme must be one of {sorted(ACTIVATION_GROUPS)}; got {scheme!r}")
    return ACTIVATION_GROUPS[scheme]


def quantize_activation(x: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) fp16/bf16/fp32 -> (codes float8_e4m3fn (M, K), scales fp32 (M, G)), G = 1 or K / 128."""
    group = check_scheme(scheme)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor (M, K); got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be float16, bfloat16 or float32; got {x.dtype}")
    M, K = (int(s) for s in x.shape)
    g = K if group is None else group
    if K < 1 or K % g:
        raise ValueError(f"{scheme} needs x's width K >= 1{'' if group is None else f' divisible by {group}'}; "
                         f"got K={K}")
    if x.stride(1) != 1:
        x = x.contiguous()
    codes = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((M, K // g), dtype=torch.float32, device=x.device)
    if M:
        _quantize_kernel[(M, K // g)](x, codes, scales, K, g, x.stride(0), codes.stride(0), scales.stride(0),
                                      BLOCK=_BLOCK)
    return codes, scales
