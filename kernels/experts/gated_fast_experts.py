"""`GatedFastExperts`: a gated-SiLU-only fast path (fused silu-and-mul Triton kernel, 128-wide tiles).

Declared as data: silu only, gated only, I % 128 == 0, 16-bit dtypes. It is a real backend (the Triton
experts' GEMMs and LoRA with its own activation kernel) and the trap an oracle must not fall into: a
non-gated or non-SiLU config sent here raises instead of computing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_lora_harness.kernels.dtypes import TRITON_16BIT_DTYPES, triton_16bit_reasons
from moe_lora_harness.kernels.experts.modular import ShapeRule
from moe_lora_harness.kernels.experts.triton_experts import ALIGN_EXPERT_LIMIT, ExpertsPlan, TritonExperts

TILE_I = 128
_FP32 = "the fast path tiles 16-bit operands only (fp32 goes to the general Triton experts)"


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, I, stride_xm, stride_om, BLOCK: tl.constexpr):
    """out[m, c] = rnd(fp32(rnd(silu(g))) * u), g = x[m, c], u = x[m, I + c] (split layout)."""
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    row = x_ptr + m.to(tl.int64) * stride_xm
    g = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(row + I + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + cols, (act * u).to(dt), mask=mask)


def silu_and_mul(cache1: torch.Tensor, cache2: torch.Tensor) -> None:
    """cache2 (M, I) = silu(cache1[:, :I]) * cache1[:, I:] with the production roundings (one launch)."""
    M, N1 = cache1.shape
    I = N1 // 2
    if tuple(cache2.shape) != (M, I) or cache2.dtype != cache1.dtype or N1 % 2:
        raise ValueError(f"silu_and_mul needs cache1 (M, 2I) and cache2 (M, I) of one dtype; got "
                         f"{tuple(cache1.shape)} {cache1.dtype} and {tuple(cache2.shape)} {cache2.dtype}")
    if M == 0:
        return
    if cache1.stride(1) != 1 or cache2.stride(1) != 1:
        raise ValueError("silu_and_mul needs unit-stride rows in cache1 and cache2")
    _silu_and_mul_kernel[(M, triton.cdiv(I, TILE_I))](cache1, cache2, I, cache1.stride(0), cache2.stride(0),
                                                       BLOCK=TILE_I)


class GatedFastExperts(TritonExperts):
    """Gated SiLU experts with a fused silu-and-mul kernel; supports LoRA, biases and EP like TritonExperts."""

    name = "gated_fast_experts"
    dtypes = TRITON_16BIT_DTYPES
    dtype_reasons = triton_16bit_reasons(_FP32)
    activations = frozenset({"silu"})
    supports_non_gated = False
    shape_rules = (ShapeRule("I % 128 == 0", lambda c: c.I % TILE_I == 0,
                             "the fused activation and GEMM tiles are 128 columns wide"),
                   ALIGN_EXPERT_LIMIT)

    def __init__(self, config):
        super().__init__(config)
        if config.activation != "silu":   # it computes nothing else: refuse before any launch
            raise ValueError(f"GatedFastExperts computes gated silu only; got activation {config.activation!r} "
                             "(the oracle should have chosen another backend)")

    def activation(self, plan: ExpertsPlan, cache1: torch.Tensor, cache2: torch.Tensor) -> None:
        """The fused silu-and-mul kernel."""
        silu_and_mul(cache1, cache2)
