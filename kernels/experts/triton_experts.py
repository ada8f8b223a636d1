"""`TritonExperts`: the fused-MoE Triton experts with LoRA (spec 5), as explicit phases.

Base: align -> w13 grouped GEMM (+bias) -> activation -> w2 grouped GEMM (+bias, routed weight folded in
before the single rounding) -> moe_sum; LoRA deltas through LoRAExpertsMixin at the two points.
FP8 schemes (docs/semantics.md 9.1): each base GEMM quantizes its input dynamically to e4m3 and multiplies e4m3
weights on the tensor cores; the LoRA deltas read the unquantized hidden states and activation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_lora_harness.kernels.dtypes import TRITON_DTYPE_REASONS, TRITON_DTYPES
from moe_lora_harness.kernels.eager_experts import SUPPORTED as _ACTIVATIONS, activation as torch_activation
from moe_lora_harness.kernels.experts.config import FP8_QUANTS
from moe_lora_harness.kernels.experts.lora_context import MoELoRAContext
from moe_lora_harness.kernels.experts.lora_mixin import LoRAAlignment, LoRAExpertsMixin
from moe_lora_harness.kernels.experts.modular import (
    FusedMoEExperts, ShapeRule, check_activations_and_routing, check_biases, check_dense_weights, check_id_ranges,
    check_lora_ctx, check_quant_weights, local_expert_ids,
)
from moe_lora_harness.kernels.triton.fp8_quant import quantize_activation
from moe_lora_harness.kernels.triton.fused_moe_gemm import choose_block_m, fused_moe_gemm
from moe_lora_harness.kernels.triton.moe_align import moe_align_block_size
from moe_lora_harness.kernels.triton.moe_sum import moe_sum
from moe_lora_harness.kernels.triton.platform import device_info

ALIGN_EXPERT_LIMIT = ShapeRule("round_up(E, 32) < 1024", lambda c: -(-c.E // 32) * 32 < 1024,
                               "the align kernels size their expert table to round_up(E, 32) < 1024")
FP8_RULES = (
    ShapeRule("FP8: 16-bit dtype", lambda c: c.quant not in FP8_QUANTS or c.dtype_name in ("float16", "bfloat16"),
              "FP8 experts quantize 16-bit activations (an fp32 model is not served with FP8 experts)"),
    ShapeRule("fp8_block: H % 128 == 0 and I % 128 == 0",
              lambda c: c.quant != "fp8_block" or (c.H % 128 == 0 and c.I % 128 == 0),
              "block scales cover 128x128 weight blocks and 128-wide activation groups along each GEMM's K"),
    ShapeRule("FP8: e4m3 tensor cores (sm_89+)",
              lambda c: c.quant not in FP8_QUANTS or c.device != "cuda" or not torch.cuda.is_available()
              or device_info("cuda").capability >= (8, 9),
              "tl.dot on float8_e4m3fn operands needs compute capability 8.9 or newer (a machine without CUDA "
              "cannot tell: the declaration holds there)"),
)


@dataclass
class ExpertsPlan:
    """Per-call state every phase reads (sizes, weights, routing, alignments); built once by `make_plan`.

    local_ids (T, k) int32: local expert per pair, -1 = non-local; valid: local_ids >= 0 (None = all).
    align: base (sorted_token_ids, expert_ids, num_tokens_post_padded) with block `block_m`;
    lora_align: the LoRA op's alignment (None without LoRA), shared by both deltas.
    """

    T: int
    k: int
    H: int
    I: int
    N1: int
    dtype: torch.dtype
    device: torch.device
    activation: str
    w13: object
    w2: object
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    expert_map: torch.Tensor | None
    local_ids: torch.Tensor
    valid: torch.Tensor | None
    mul_routed_weight: bool
    block_m: int
    align: tuple
    lora_align: LoRAAlignment | None


class TritonExperts(LoRAExpertsMixin, FusedMoEExperts):
    """Triton fused-MoE experts with LoRA: every activation (gated and `_no_mul`), biases, EP, fp16/bf16/fp32.

    `apply` is the sequential composition of phases, each taking its buffers as arguments:
      plan = make_plan(...);  cache1, cache2, cache3 = workspaces(plan)     # (T*k, N1), (T*k, I), (T*k, H)
      base_w13(plan, x, cache1)                   x: prepared input (T, H)
      lora_w13(plan, ctx, x_orig, out, add_inputs)  out (T*k, N1): += delta, or = delta into a zeroed buffer
      activation(plan, cache1, cache2)
      base_w2(plan, cache2, cache3)
      lora_w2(plan, ctx, cache2, out, add_inputs)   out (T*k, H)
      moe_sum(plan, cache3, output)               output (T, H)
    so a subclass may reorder them (e.g. LoRA deltas on another stream) without touching the math.
    """

    name = "triton_experts"
    devices = frozenset({"cpu", "cuda"})
    dtypes = TRITON_DTYPES
    dtype_reasons = TRITON_DTYPE_REASONS
    activations = frozenset(_ACTIVATIONS)
    supports_non_gated = True
    quant_schemes = frozenset({"none", *FP8_QUANTS})
    supports_bias = True
    supports_ep = True
    supports_fully_sharded = True
    max_lora_rank = None
    shape_rules = (ALIGN_EXPERT_LIMIT, *FP8_RULES)

    # ------------------------------------------------------------------ plan and workspaces
    def check_weights(self, w13, w2, w13_bias, w2_bias) -> None:
        """Unquantized weights, or QuantWeights of the config's FP8 scheme, and biases matching the config."""
        if self.config.quant in FP8_QUANTS:
            check_quant_weights(self.config, w13, w2)
            check_biases(self.config, w13_bias, w2_bias)
        else:
            check_dense_weights(self.config, w13, w2, w13_bias, w2_bias)

    def make_plan(self, output, hidden_states, w13, w2, topk_weights, topk_ids, *, expert_map=None,
                  w13_bias=None, w2_bias=None, lora_ctx: MoELoRAContext | None = None) -> ExpertsPlan:
        """Validate every argument (before any launch), then build the base and LoRA alignments."""
        c = self.config
        T = check_activations_and_routing(c, output, hidden_states, topk_weights, topk_ids, expert_map)
        self.check_weights(w13, w2, w13_bias, w2_bias)
        check_lora_ctx(c, lora_ctx, T, self.supports_lora())
        if lora_ctx is not None:
            x0 = lora_ctx.original_hidden_states
            if x0 is not None and (not isinstance(x0, torch.Tensor) or tuple(x0.shape) != (T, c.H)
                                   or x0.dtype != c.dtype):
                raise ValueError(f"lora_ctx.original_hidden_states must be a ({T}, {c.H}) {c.dtype} tensor; got "
                                 f"{getattr(x0, 'dtype', type(x0).__name__)} {tuple(getattr(x0, 'shape', ()))}")
        check_id_ranges(c, topk_ids, expert_map, lora_ctx)
        k = c.top_k
        local, valid = local_expert_ids(topk_ids, expert_map)
        bm = choose_block_m(T * k, c.E, fp8=c.quant in FP8_QUANTS)
        align = moe_align_block_size(topk_ids, bm, c.E, expert_map) if T else None
        lora_align = None
        if lora_ctx is not None and T:
            lora_align = self.lora_alignment(lora_ctx, local, expert_map=expert_map is not None)
        return ExpertsPlan(T=T, k=k, H=c.H, I=c.I, N1=c.N1, dtype=c.dtype, device=hidden_states.device,
                           activation=c.activation, w13=w13, w2=w2, w13_bias=w13_bias, w2_bias=w2_bias,
                           topk_weights=topk_weights, topk_ids=topk_ids, expert_map=expert_map, local_ids=local,
                           valid=valid, mul_routed_weight=not c.apply_router_weight_on_input, block_m=bm,
                           align=align, lora_align=lora_align)

    def workspaces(self, plan: ExpertsPlan):
        """(cache1 (T*k, N1), cache2 (T*k, I), cache3 (T*k, H)); zeroed under EP (non-local rows stay 0)."""
        alloc = torch.zeros if plan.valid is not None else torch.empty
        P = plan.T * plan.k
        kw = dict(dtype=plan.dtype, device=plan.device)
        return alloc(P, plan.N1, **kw), alloc(P, plan.I, **kw), alloc(P, plan.H, **kw)

    # ------------------------------------------------------------------ phases
    def _gemm_input(self, x: torch.Tensor, w, bias) -> tuple[torch.Tensor, dict]:
        """(the GEMM's x, its weight arguments): under an FP8 scheme x's e4m3 codes with their scales (dynamic,
        per row or per row and 128 columns) and the QuantWeights; else x and the dense weights."""
        quant = self.config.quant
        if quant in FP8_QUANTS:
            codes, scales = quantize_activation(x, quant)
            return codes, dict(w=None, quant=w, bias=bias, x_scales=scales)
        return x, dict(w=w, quant=None, bias=bias)

    def base_w13(self, plan: ExpertsPlan, x: torch.Tensor, out: torch.Tensor) -> None:
        """out (T*k, N1) = rnd(x[t] @ w13[e]^T + b13[e]) for every local pair (x quantized first under FP8)."""
        ids, eids, ntpp = plan.align
        x, weights = self._gemm_input(x, plan.w13, plan.w13_bias)
        fused_moe_gemm(out, x, sorted_token_ids=ids, expert_ids=eids, num_tokens_post_padded=ntpp, top_k=plan.k,
                       x_row_div=plan.k, block_m=plan.block_m, **weights)

    def lora_w13(self, plan: ExpertsPlan, ctx: MoELoRAContext, x: torch.Tensor, out: torch.Tensor,
                 add_inputs: bool = True) -> None:
        """w13 LoRA delta of x (T, H) (the original hidden states) into out (T*k, N1) (spec 5, first point)."""
        self.apply_w13_lora(ctx, y=out.view(plan.T, plan.k, plan.N1), x=x, topk_ids=plan.local_ids,
                            topk_weights=plan.topk_weights, expert_map=plan.expert_map is not None,
                            align=plan.lora_align, add_inputs=add_inputs)

    def activation(self, plan: ExpertsPlan, cache1: torch.Tensor, cache2: torch.Tensor) -> None:
        """cache2 (T*k, I) = act(cache1) with the production rounding points (spec 6)."""
        cache2.copy_(torch_activation(cache1, plan.activation))

    def base_w2(self, plan: ExpertsPlan, cache2: torch.Tensor, out: torch.Tensor) -> None:
        """out (T*k, H) = rnd(w_p * (cache2[p] @ w2[e]^T + b2[e])) (unweighted under router-weight-on-input;
        cache2 quantized first under FP8, the LoRA reading it unquantized)."""
        ids, eids, ntpp = plan.align
        x, weights = self._gemm_input(cache2, plan.w2, plan.w2_bias)
        fused_moe_gemm(out, x, sorted_token_ids=ids, expert_ids=eids, num_tokens_post_padded=ntpp,
                       top_k=plan.k, x_row_div=1, topk_weights=plan.topk_weights,
                       mul_routed_weight=plan.mul_routed_weight, block_m=plan.block_m, **weights)

    def lora_w2(self, plan: ExpertsPlan, ctx: MoELoRAContext, cache2: torch.Tensor, out: torch.Tensor,
                add_inputs: bool = True) -> None:
        """Weighted w2 LoRA delta of cache2 (T*k, I) into out (T*k, H) (spec 5, second point)."""
        self.apply_w2_lora(ctx, y=out.view(plan.T, plan.k, plan.H), x=cache2, topk_weights=plan.topk_weights,
                           align=plan.lora_align, add_inputs=add_inputs)

    def moe_sum(self, plan: ExpertsPlan, cache3: torch.Tensor, output: torch.Tensor) -> None:
        """output (T, H) = rnd(sum_j fp32(cache3[t, j])) over local pairs."""
        moe_sum(cache3.view(plan.T, plan.k, plan.H), output, plan.valid)

    # ------------------------------------------------------------------ composition
    def apply(self, output, hidden_states, w13, w2, topk_weights, topk_ids, *, expert_map=None,
              w13_bias=None, w2_bias=None, lora_ctx: MoELoRAContext | None = None) -> None:
        """The (T, H) expert output into `output`: the phases above, in order, on one stream."""
        plan = self.make_plan(output, hidden_states, w13, w2, topk_weights, topk_ids, expert_map=expert_map,
                              w13_bias=w13_bias, w2_bias=w2_bias, lora_ctx=lora_ctx)
        if plan.T == 0:
            return
        x_lora = lora_ctx.w13_lora_input(hidden_states) if lora_ctx is not None else None
        cache1, cache2, cache3 = self.workspaces(plan)
        self.base_w13(plan, hidden_states, cache1)
        if lora_ctx is not None:
            self.lora_w13(plan, lora_ctx, x_lora, cache1)
        self.activation(plan, cache1, cache2)
        self.base_w2(plan, cache2, cache3)
        if lora_ctx is not None:
            self.lora_w2(plan, lora_ctx, cache2, cache3)
        self.moe_sum(plan, cache3, output)
