"""`OAIExperts`: gather/scatter experts (gpt-oss style): pairs permuted into per-expert segments.

Base: permute_pairs -> grouped GEMM w13 (+bias, x rows gathered by pair) -> swigluoai (interleaved,
clamp 7.0, alpha 1.702) -> grouped GEMM w2 (+bias, routed weight folded in) -> scatter_sum back to tokens.
LoRA runs IN THE PERMUTED LAYOUT: row i of the permuted caches is pair p = perm[i], so the LoRA op sees
P_local "tokens" with top_k 1: x rows hidden[p // k] (w13) or the permuted activations (w2), routing
weight w[p], token->LoRA map mapping[p // k], expert = the segment's local expert. The alignment over
these rows is built once (naive or sorted by vLLM's sparsity rule) and the op path is forced to
one-shot (two-kernel for rank > 128 or fully sharded), so the rounding model does not depend on P_local.
"""
from __future__ import annotations

import torch

from moe_lora_harness.kernels.dtypes import TRITON_DTYPE_REASONS, TRITON_DTYPES
from moe_lora_harness.kernels.eager_experts import OAI_ALPHA, OAI_LIMIT
from moe_lora_harness.kernels.experts.config import MoEConfig
from moe_lora_harness.kernels.experts.lora_context import MoELoRAContext
from moe_lora_harness.kernels.experts.lora_mixin import LoRAExpertsMixin, build_lora_alignment
from moe_lora_harness.kernels.experts.modular import (
    FusedMoEExperts, check_activations_and_routing, check_dense_weights, check_id_ranges, check_lora_ctx,
)
from moe_lora_harness.kernels.experts.triton_experts import ALIGN_EXPERT_LIMIT
from moe_lora_harness.kernels.triton.grouped_gemm import grouped_gemm, permute_pairs, scatter_sum
from moe_lora_harness.kernels.triton.one_shot import one_shot_unsupported


def swigluoai_and_mul(cache1: torch.Tensor) -> torch.Tensor:
    """(M, 2I) interleaved [g0, u0, g1, u1, ...] -> (M, I): rnd((u' + 1) * g' * sigmoid(1.702 g')) in fp32,
    g' = min(g, 7), u' = clamp(u, -7, 7); one rounding (spec 6)."""
    x = cache1.float()
    g = x[:, 0::2].clamp(max=OAI_LIMIT)
    u = x[:, 1::2].clamp(-OAI_LIMIT, OAI_LIMIT)
    return ((u + 1.0) * (g * torch.sigmoid(OAI_ALPHA * g))).to(cache1.dtype)


class OAIExperts(LoRAExpertsMixin, FusedMoEExperts):
    """Gather/scatter grouped-GEMM experts for swigluoai (interleaved gate/up), biases, EP, LoRA."""

    name = "oai_experts"
    devices = frozenset({"cpu", "cuda"})
    dtypes = TRITON_DTYPES
    dtype_reasons = TRITON_DTYPE_REASONS
    activations = frozenset({"swigluoai"})
    supports_non_gated = False
    quant_schemes = frozenset({"none"})
    supports_bias = True
    supports_ep = True
    supports_fully_sharded = True
    shape_rules = (ALIGN_EXPERT_LIMIT,)

    def __init__(self, config: MoEConfig):
        super().__init__(config)
        if config.activation != "swigluoai":   # its activation is swigluoai only: refuse before any launch
            raise ValueError(f"OAIExperts computes the interleaved swigluoai activation only; got "
                             f"{config.activation!r}")

    @classmethod
    def lora_path(cls, config: MoEConfig, num_tokens: int, max_loras: int) -> str:
        """Forced: one_shot (rank <= 128, not fully sharded), else two_kernel; independent of T."""
        return "two_kernel" if one_shot_unsupported(config.max_lora_rank, config.fully_sharded) else "one_shot"

    def apply(self, output, hidden_states, w13, w2, topk_weights, topk_ids, *, expert_map=None,
              w13_bias=None, w2_bias=None, lora_ctx: MoELoRAContext | None = None) -> None:
        """(T, H) output via the permuted layout; LoRA deltas added to the permuted caches."""
        c = self.config
        T = check_activations_and_routing(c, output, hidden_states, topk_weights, topk_ids, expert_map)
        check_dense_weights(c, w13, w2, w13_bias, w2_bias)
        check_lora_ctx(c, lora_ctx, T, self.supports_lora())
        check_id_ranges(c, topk_ids, expert_map, lora_ctx)
        if T == 0:
            return
        k = c.top_k
        perm, seg = permute_pairs(topk_ids, c.E, expert_map)
        P = int(perm.numel())
        dt, dev = hidden_states.dtype, hidden_states.device
        cache1 = torch.empty(P, c.N1, dtype=dt, device=dev)
        cache3 = torch.empty(P, c.H, dtype=dt, device=dev)
        grouped_gemm(cache1, hidden_states, w13, perm, seg, x_row_div=k, bias=w13_bias)
        lora = None
        if lora_ctx is not None and P:
            lora = self._permuted_lora_inputs(lora_ctx, hidden_states, topk_weights, topk_ids, expert_map, perm)
            self.apply_w13_lora(lora_ctx, y=cache1.view(P, 1, c.N1), x=lora["x"], topk_ids=lora["ids"],
                                topk_weights=lora["w"], align=lora["align"])
        cache2 = swigluoai_and_mul(cache1)
        grouped_gemm(cache3, cache2, w2, perm, seg, x_row_div=1, x_permuted=True, bias=w2_bias,
                     topk_weights=topk_weights, mul_routed_weight=not c.apply_router_weight_on_input,
                     num_pairs=T * k)
        if lora is not None:
            self.apply_w2_lora(lora_ctx, y=cache3.view(P, 1, c.H), x=cache2, topk_weights=lora["w"],
                               align=lora["align"])
        scatter_sum(output, cache3, perm, k)

    def _permuted_lora_inputs(self, ctx, hidden_states, topk_weights, topk_ids, expert_map, perm) -> dict:
        """LoRA op inputs for the permuted rows: x (P, H), weights (P, 1), local ids (P, 1), alignment."""
        k = self.config.top_k
        tok = torch.div(perm, k, rounding_mode="floor")
        x0 = ctx.w13_lora_input(hidden_states)
        ids = topk_ids.reshape(-1)[perm]
        if expert_map is not None:
            ids = expert_map[ids.long()]
        ids = ids.to(torch.int32).view(-1, 1).contiguous()
        w = topk_weights.reshape(-1)[perm].to(torch.float32).view(-1, 1).contiguous()
        mapping = ctx.mapping[tok].contiguous()
        path = self.lora_path(self.config, int(topk_ids.shape[0]), ctx.max_loras)
        align = build_lora_alignment(ctx, ids, expert_map=expert_map is not None, mapping=mapping, path=path)
        return dict(x=x0[tok].contiguous(), w=w, ids=ids, align=align)
