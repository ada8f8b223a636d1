"""Weight-only quantization grids for Marlin-style experts: symmetric int4 with group scales along K
(group size 128) and int8 with one scale per output channel.

The quantization-aware comparison snaps weights to the grid once; kernels receive (q, scales) and the
reference runs on `dequantize(q, scales)`, so quantization error is out of the comparison and what is
compared is the kernel's arithmetic. Dequantized value: rnd_dt(fp32(q) * fp32(scale)), one rounding.
"""
from __future__ import annotations

import torch

SCHEMES = {"int4_g128": (7, -8, 128), "int8_channel": (127, -127, None)}   # qmax, qmin, group (None=channel)


def _scheme(name: str):
    if name not in SCHEMES:
        raise ValueError(f"quant scheme must be one of {sorted(SCHEMES)}; got {name!r}")
    return SCHEMES[name]


def quantize(w: torch.Tensor, scheme: str, dtype: torch.dtype):
    """w (E, N, K) -> (q int8 (E, N, K), scales dtype (E, N, K/group) or (E, N)).

    Scales are amax / qmax per group (per channel for int8), stored in `dtype`, never zero.
    """
    qmax, qmin, group = _scheme(scheme)
    if w.dim() != 3:
        raise ValueError(f"w must be (E, N, K); got shape {tuple(w.shape)}")
    E, N, K = w.shape
    w32 = w.float()
    if group is None:
        amax = w32.abs().amax(dim=2)
        scales = (amax / qmax).clamp_min(1e-8).to(dtype)
        s = scales.float().unsqueeze(2)
    else:
        if K % group:
            raise ValueError(f"{scheme} needs K (the input dim) divisible by {group}; got K={K}")
        amax = w32.view(E, N, K // group, group).abs().amax(dim=3)
        scales = (amax / qmax).clamp_min(1e-8).to(dtype)
        s = scales.float().repeat_interleave(group, dim=2)
    q = torch.clamp(torch.round(w32 / s), qmin, qmax).to(torch.int8)
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, scheme: str, dtype: torch.dtype) -> torch.Tensor:
    """(q, scales) -> weights in `dtype`: fp32(q) * fp32(scale), rounded once."""
    _, _, group = _scheme(scheme)
    s = scales.float().unsqueeze(2) if group is None else scales.float().repeat_interleave(group, dim=2)
    return (q.float() * s).to(dtype)
