"""No-DP/EP prepare and finalize: the router weight goes on the input when asked, finalize is identity.

Single process: with an expert map, non-local pairs contribute nothing (the experts skip them); there is
no dispatch or combine yet.
"""
from __future__ import annotations

import torch

from moe_lora_harness.kernels.experts.config import MoEConfig


class NoEPPrepareAndFinalize:
    """prepare: x = rnd(x * rnd(w)) under apply_router_weight_on_input (top_k 1), else x; finalize: identity."""

    def prepare(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                config: MoEConfig) -> torch.Tensor:
        """The experts' input: the hidden states, scaled by the (dt-rounded) router weight when configured."""
        if not config.apply_router_weight_on_input:
            return hidden_states
        if not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != (hidden_states.shape[0], 1):
            raise ValueError(f"topk_weights must have shape (T, 1) under apply_router_weight_on_input; got "
                             f"{tuple(getattr(topk_weights, 'shape', ()))}")
        # both operands in dt: the product of two dt values is exact in fp32, then one rounding
        return hidden_states * topk_weights.to(hidden_states.dtype)

    def finalize(self, output: torch.Tensor, config: MoEConfig) -> torch.Tensor:
        """Nothing to combine on one process: the experts' moe_sum already wrote the layer output."""
        return output
