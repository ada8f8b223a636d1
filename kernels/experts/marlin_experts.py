"""`MarlinExperts`: weight-only int4 (group 128) / int8 (per channel) experts, dequantized inside the GEMM.

`fused_marlin_moe` is the outer wrapper (align, quantized w13 GEMM, activation, quantized w2 GEMM, sum)
with two hooks; MarlinExperts passes LoRA in through them as closures: an activation-with-LoRA closure
(w13 delta, then the activation) and a moe-sum-with-LoRA closure (w2 delta, then the sum), which are
the same logical points as the Triton experts'.
"""
from __future__ import annotations

from typing import Callable

import torch

from moe_lora_harness.kernels.dtypes import TRITON_16BIT_DTYPES, triton_16bit_reasons
from moe_lora_harness.kernels.eager_experts import SUPPORTED as _ACTIVATIONS, activation as torch_activation
from moe_lora_harness.kernels.experts.lora_context import MoELoRAContext
from moe_lora_harness.kernels.experts.lora_mixin import LoRAExpertsMixin
from moe_lora_harness.kernels.experts.modular import (
    FusedMoEExperts, ShapeRule, check_activations_and_routing, check_biases, check_id_ranges,
    check_lora_ctx, check_quant_weights, local_expert_ids,
)
from moe_lora_harness.kernels.experts.triton_experts import ALIGN_EXPERT_LIMIT
from moe_lora_harness.kernels.triton.fused_moe_gemm import choose_block_m, fused_moe_gemm
from moe_lora_harness.kernels.triton.moe_align import moe_align_block_size
from moe_lora_harness.kernels.triton.moe_sum import moe_sum
from moe_lora_harness.kernels.triton.quant_gemm import QuantWeights

_FP32 = "the Marlin-style dequant GEMM computes in 16-bit (fp16/bf16) only"


def _plain_activation(name: str) -> Callable:
    """The default activation hook: cache2 = act(cache1) with the production roundings."""
    def act(cache1, cache2):
        """cache2 = act(cache1), no LoRA."""
        cache2.copy_(torch_activation(cache1, name))
    return act


def fused_marlin_moe(hidden_states: torch.Tensor, w13: QuantWeights, w2: QuantWeights, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, *, activation: str, output: torch.Tensor, expert_map=None,
                     w13_bias=None, w2_bias=None, apply_router_weight_on_input: bool = False,
                     activation_fn: Callable | None = None, moe_sum_fn: Callable | None = None) -> torch.Tensor:
    """Quantized-weight MoE forward into `output` (T, H); returns it. Arguments are assumed validated.

    Hooks: activation_fn(cache1 (T*k, N1), cache2 (T*k, I)) replaces the activation;
    moe_sum_fn(cache3 (T*k, H), output (T, H), cache2) replaces the final sum.
    """
    T, k = (int(s) for s in topk_ids.shape)
    if T == 0:
        return output
    E, N1, H, I = w13.num_experts, w13.N, w13.K, w2.K
    dt, dev = hidden_states.dtype, hidden_states.device
    valid = local_expert_ids(topk_ids, expert_map)[1]
    bm = choose_block_m(T * k, E)
    ids, eids, ntpp = moe_align_block_size(topk_ids, bm, E, expert_map)
    alloc = torch.zeros if valid is not None else torch.empty
    cache1 = alloc(T * k, N1, dtype=dt, device=dev)
    cache2 = alloc(T * k, I, dtype=dt, device=dev)
    cache3 = alloc(T * k, H, dtype=dt, device=dev)
    fused_moe_gemm(cache1, hidden_states, None, ids, eids, ntpp, top_k=k, x_row_div=k, bias=w13_bias, block_m=bm,
                   quant=w13)
    (activation_fn or _plain_activation(activation))(cache1, cache2)
    fused_moe_gemm(cache3, cache2, None, ids, eids, ntpp, top_k=k, x_row_div=1, topk_weights=topk_weights,
                   mul_routed_weight=not apply_router_weight_on_input, bias=w2_bias, block_m=bm, quant=w2)
    if moe_sum_fn is not None:
        moe_sum_fn(cache3, output, cache2)
    else:
        moe_sum(cache3.view(T, k, H), output, valid)
    return output


class MarlinExperts(LoRAExpertsMixin, FusedMoEExperts):
    """Weight-only quantized experts through `fused_marlin_moe`; LoRA enters via the wrapper's hooks."""

    name = "marlin_experts"
    devices = frozenset({"cpu", "cuda"})
    dtypes = TRITON_16BIT_DTYPES
    dtype_reasons = triton_16bit_reasons(_FP32)
    activations = frozenset(_ACTIVATIONS)
    supports_non_gated = True
    quant_schemes = frozenset({"int4_g128", "int8_channel"})
    supports_bias = True
    supports_ep = True
    supports_fully_sharded = True
    shape_rules = (ShapeRule("int4_g128: H % 128 == 0 and I % 128 == 0",
                             lambda c: c.quant != "int4_g128" or (c.H % 128 == 0 and c.I % 128 == 0),
                             "int4 scales cover groups of 128 along each GEMM's K (H for w13, I for w2)"),
                   ALIGN_EXPERT_LIMIT)

    def apply(self, output, hidden_states, w13, w2, topk_weights, topk_ids, *, expert_map=None,
              w13_bias=None, w2_bias=None, lora_ctx: MoELoRAContext | None = None) -> None:
        """Validate, then run fused_marlin_moe with LoRA closures when a context is given."""
        c = self.config
        T = check_activations_and_routing(c, output, hidden_states, topk_weights, topk_ids, expert_map)
        check_quant_weights(c, w13, w2)
        check_biases(c, w13_bias, w2_bias)
        check_lora_ctx(c, lora_ctx, T, self.supports_lora())
        check_id_ranges(c, topk_ids, expert_map, lora_ctx)
        hooks = {}
        if lora_ctx is not None and T:
            hooks = self._lora_hooks(lora_ctx, hidden_states, topk_weights, topk_ids, expert_map)
        fused_marlin_moe(hidden_states, w13, w2, topk_weights, topk_ids, activation=c.activation, output=output,
                         expert_map=expert_map, w13_bias=w13_bias, w2_bias=w2_bias,
                         apply_router_weight_on_input=c.apply_router_weight_on_input, **hooks)

    def _lora_hooks(self, ctx: MoELoRAContext, hidden_states, topk_weights, topk_ids, expert_map) -> dict:
        """The activation-with-LoRA and moe-sum-with-LoRA closures (alignment built once, shared)."""
        c = self.config
        T, k = (int(s) for s in topk_ids.shape)
        local, valid = local_expert_ids(topk_ids, expert_map)
        align = self.lora_alignment(ctx, local, expert_map=expert_map is not None)
        x_lora = ctx.w13_lora_input(hidden_states)
        plain = _plain_activation(c.activation)

        def activation_with_lora(cache1, cache2):
            """w13 delta into cache1 (before the activation), then the activation."""
            self.apply_w13_lora(ctx, y=cache1.view(T, k, c.N1), x=x_lora, topk_ids=local, topk_weights=topk_weights,
                                expert_map=expert_map is not None, align=align)
            plain(cache1, cache2)

        def moe_sum_with_lora(cache3, out, cache2):
            """Weighted w2 delta into cache3 (before the sum), then moe_sum."""
            self.apply_w2_lora(ctx, y=cache3.view(T, k, c.H), x=cache2, topk_weights=topk_weights, align=align)
            moe_sum(cache3.view(T, k, c.H), out, valid)

        return dict(activation_fn=activation_with_lora, moe_sum_fn=moe_sum_with_lora)
