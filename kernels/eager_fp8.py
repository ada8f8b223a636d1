"""FP8 pieces of the eager experts (docs/semantics.md 9.1): the dynamic e4m3 activation quantizer and the scaled
GEMM, in torch ops, written independently of reference/ (kernels never import it).

`Fp8Ops` bundles them with the choice of the LoRA's input, so a planted-bug corpus can swap one piece
(suites/experts/fp8_mutants.py); `FP8_OPS` is the correct set.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moe_lora_harness.kernels.fp8_schemes import ACTIVATION_GROUPS as GROUPS, AMAX_FLOOR, E4M3_MAX, WEIGHT_BLOCKS


def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, clamped to +-448 first (vLLM's quantizers clamp; the cast's own overflow handling
    is not relied on)."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _over_e4m3_max(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 rounded once in fp32, on every device: PyTorch divides a CUDA tensor by a Python scalar as a
    multiply by its fp32 reciprocal, and fl(1/448) rounds up, so there no x / scale ever passed 448."""
    return amax / torch.full_like(amax, E4M3_MAX)


def quantize_activation(x: torch.Tensor, group: int | None, convert: Callable = to_e4m3):
    """x (M, K) dt -> (codes e4m3 (M, K), scales fp32 (M, G)): per row (group None) or per 128 along K; amax / 448
    of the group in fp32 (floored), codes = e4m3(x / scale)."""
    M, K = x.shape
    g = K if group is None else group
    xf = x.float().view(M, K // g, g)
    scales = _over_e4m3_max(xf.abs().amax(dim=2).clamp_min(AMAX_FLOOR))
    codes = convert(xf / scales.unsqueeze(2)).view(M, K)
    return codes, scales


def quantize_activation_per_tensor(x: torch.Tensor, group: int | None, convert: Callable = to_e4m3):
    """One scale for the whole tensor (what per-token/per-group dynamic quantization is not), expanded to the
    per-row/per-group shape the GEMM reads."""
    M, K = x.shape
    g = K if group is None else group
    scale = _over_e4m3_max(x.float().abs().amax().clamp_min(AMAX_FLOOR))
    return convert(x.float() / scale), scale.expand(M, K // g).contiguous()


def scaled_gemm(codes: torch.Tensor, scales: torch.Tensor, w_codes: torch.Tensor, w_scales: torch.Tensor,
                block: int | None) -> torch.Tensor:
    """(M, K) e4m3 activations x (N, K) e4m3 weights^T -> fp32 (M, N): products accumulated in fp32, the scales
    applied to the accumulator (per K group of 128 for block weights, whose scales are (N/128, K/128))."""
    a = codes.float()
    w = w_codes.float()
    if block is None:     # one activation scale per row, one weight scale per output channel
        return (a @ w.t()) * scales[:, :1] * w_scales.float().unsqueeze(0)
    M, K = a.shape
    N = w.shape[0]
    acc = torch.zeros(M, N, dtype=torch.float32, device=a.device)
    for kb in range(K // block):
        ks = slice(kb * block, (kb + 1) * block)
        ws = w_scales[:, kb].float().repeat_interleave(block)          # (N,): each output row's block scale
        acc += (a[:, ks] @ w[:, ks].t()) * scales[:, kb:kb + 1] * ws.unsqueeze(0)
    return acc


def unquantized_input(x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The LoRA's input: the unquantized activation (vLLM after #42007)."""
    return x


@dataclass(frozen=True)
class Fp8Ops:
    """The FP8 steps the eager experts take; each may be swapped by a planted bug."""

    quantize: Callable = quantize_activation
    gemm: Callable = scaled_gemm
    lora_input: Callable = unquantized_input     # (unquantized x, its e4m3 codes) -> what the LoRA reads


FP8_OPS = Fp8Ops()
