"""Planted FP8 bugs in the eager experts (issue 22 item 4), each one swapped step of kernels.eager_fp8.Fp8Ops.

BACKENDS: `fp8-control` (the correct steps) and the mutants selftest's "fp8" corpus attacks.
"""
from __future__ import annotations

import dataclasses

import torch

from moe_lora_harness.backends.eager import run_experts
from moe_lora_harness.harness.spec.contract import BackendSpec, Capabilities
from moe_lora_harness.kernels import eager_experts, eager_fp8

FP8 = frozenset(eager_fp8.GROUPS)


def _raw_codes(x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """vLLM #42007: the LoRA reads the e4m3 codes as values, without their scale."""
    return codes.to(x.dtype)


def _gemm_next_block(codes, scales, w_codes, w_scales, block):
    """The weight scale of the next output block (index off by one block, wrapping)."""
    return eager_fp8.scaled_gemm(codes, scales, w_codes, torch.roll(w_scales, -1, dims=0), block)


def _cast_unsaturated(v: torch.Tensor) -> torch.Tensor:
    """An e4m3 conversion without saturation: past 448 the value is lost (NaN, e4m3fn has no inf)."""
    return torch.where(v.abs() > eager_fp8.E4M3_MAX, torch.full_like(v, float("nan")), v).to(torch.float8_e4m3fn)


def _quantize_unsaturated(x, group):
    return eager_fp8.quantize_activation(x, group, convert=_cast_unsaturated)


def _ops(**changes) -> eager_fp8.Fp8Ops:
    return dataclasses.replace(eager_fp8.FP8_OPS, **changes)


# name -> (what it does, its FP8 steps, the schemes it claims)
_PLANTED = {
    "fp8-control": ("No mistake: the eager experts' FP8 steps.", _ops(), FP8),
    "fp8-lora-reads-codes": ("The LoRA deltas read the quantized activation's raw e4m3 codes (vLLM #42007).",
                             _ops(lora_input=_raw_codes), FP8),
    "fp8-scale-per-tensor": ("One dynamic activation scale for the whole tensor, not per token / token-group.",
                             _ops(quantize=eager_fp8.quantize_activation_per_tensor), FP8),
    "fp8-block-scale-next": ("Each output block reads the next block's weight scale (index off by one).",
                             _ops(gemm=_gemm_next_block), frozenset({"fp8_block"})),
    # caught where the amax element's x / s rounds past 448 in fp32 (s = amax / 448 rounded down): 8 % of fp16 and
    # bf16 amax values, so a few rows of a case; a conversion that rounds to nearest before overflowing would map it
    # to 448 and be equivalent, and so was a scale of amax x fl(1/448) (eager_fp8._over_e4m3_max says why)
    "fp8-no-saturation": ("No clamp before an e4m3 conversion that loses values past 448 (NaN).",
                          _ops(quantize=_quantize_unsaturated), FP8),
}
def _spec(name: str, doc: str, ops: eager_fp8.Fp8Ops, schemes: frozenset) -> BackendSpec:
    return BackendSpec(name=name, description=doc,
                       capabilities=Capabilities(levels=frozenset({"expert"}), quant=schemes,
                                                 activations=frozenset(eager_experts.SUPPORTED)),
                       experts=lambda call: run_experts(call, fp8_ops=ops), precision="one_shot")


BACKENDS = [_spec(name, doc, ops, schemes) for name, (doc, ops, schemes) in _PLANTED.items()]
