"""Weight-only quantization grids for Marlin-style experts: symmetric int4 with group scales along K
(group size 128) and int8 with one scale per output channel.

The quantization-aware comparison snaps weights to the grid once; kernels receive (q, scales) and the
reference runs on `dequantize(q, scales)`, so quantization error is out of the comparison and what is
compared is the kernel's arithmetic. Dequantized value: rnd_dt(fp32(q) * fp32(scale)), one rounding.
"""
from __future__ import annotations

import torch

from moe_lora_harness.reference import fp8

SCHEMES = {"int4_g128": (7, -8, 128), "int8_channel": (127, -127, None)}   # qmax, qmin, group (None=channel)
# schemes whose activations are quantized too (reference.fp8): weights as e4m3 codes with fp32 scales
ACTIVATION_SCHEMES = tuple(fp8.SCHEMES)


def _scheme(name: str):
    if name not in SCHEMES:
        raise ValueError(f"quant scheme must be one of {sorted(SCHEMES) + list(ACTIVATION_SCHEMES)}; got {name!r}")
    return SCHEMES[name]


def quantize(w: torch.Tensor, scheme: str, dtype: torch.dtype):
    """w (E, N, K) -> (q int8 (E, N, K), scales dtype (E, N, K/group) or (E, N)), on w's device.

    Scales are amax / qmax per group (per channel for int8), stored in `dtype`, never zero. One expert at a
    time (every step is per element or per group), so an fp32 copy of a whole layer never exists.
    An FP8 scheme: reference.fp8.quantize_weights (e4m3 codes, fp32 scales), then `_fp8_exact_in`.
    """
    if scheme in ACTIVATION_SCHEMES:
        return _fp8_exact_in(*fp8.quantize_weights(w, scheme), scheme, dtype)
    qmax, qmin, group = _scheme(scheme)
    if w.dim() != 3:
        raise ValueError(f"w must be (E, N, K); got shape {tuple(w.shape)}")
    E, N, K = w.shape
    if group is not None and K % group:
        raise ValueError(f"{scheme} needs K (the input dim) divisible by {group}; got K={K}")
    q = torch.empty((E, N, K), dtype=torch.int8, device=w.device)
    scales = torch.empty((E, N) if group is None else (E, N, K // group), dtype=dtype, device=w.device)
    for e in range(E):
        w32 = w[e].float()
        if group is None:
            scales[e] = (w32.abs().amax(dim=1) / qmax).clamp_min(1e-8).to(dtype)
            s = scales[e].float().unsqueeze(1)
        else:
            amax = w32.view(N, K // group, group).abs().amax(dim=2)
            scales[e] = (amax / qmax).clamp_min(1e-8).to(dtype)
            s = scales[e].float().repeat_interleave(group, dim=1)
        q[e] = torch.clamp(torch.round(w32 / s), qmin, qmax).to(torch.int8)
    return q, scales


def _fp8_exact_in(codes: torch.Tensor, scales: torch.Tensor, scheme: str, dtype: torch.dtype):
    """(codes, scales) with every code whose value code x scale lies below `dtype`'s smallest normal drawn as 0.

    code x scale has at most 8 significant bits: exact in fp16/bf16 when normal, not always below (fp16's subnormals
    keep fewer bits). The kernel multiplies in fp32, the reference reads the weights in `dtype`; so that both read
    the same weights, the harness draws such tiny weights (under 2^-14 in fp16, a thousandth of a typical weight
    at DeepSeek-V3's K) as exact zeros. Scales are unchanged (they come from the block's amax)."""
    tiny = torch.finfo(dtype).tiny
    E, N, K = codes.shape
    for e in range(E):
        value = codes[e].to(torch.float64) * fp8.weight_scale_view(scales[e], N, K, scheme)
        codes[e] = torch.where(value.abs() < tiny, torch.zeros_like(value), codes[e].to(torch.float64)).to(codes.dtype)
    return codes, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, scheme: str, dtype: torch.dtype) -> torch.Tensor:
    """(q, scales) -> weights in `dtype`: fp32(q) * fp32(scale), rounded once (one expert at a time)."""
    if scheme in ACTIVATION_SCHEMES:
        return fp8.dequantize_weights(q, scales, scheme, dtype)
    _, _, group = _scheme(scheme)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for e in range(q.shape[0]):
        s = scales[e].float().unsqueeze(1) if group is None else scales[e].float().repeat_interleave(group, dim=1)
        out[e] = (q[e].float() * s).to(dtype)
    return out
