"""The pure-PyTorch eager backend: torch ops in the working dtype, no Triton, every device and dtype."""
from moe_lora_harness.harness.spec.contract import BackendSpec, Capabilities
from moe_lora_harness.kernels import eager, eager_experts, eager_fp8


def run_experts(call, fp8_ops=eager_fp8.FP8_OPS):
    """ExpertCall -> kernels.eager_experts (writes call.output); `fp8_ops`: the FP8 steps (a planted bug swaps one)."""
    eager_experts.moe_experts_forward(
        call.output, call.hidden_states, call.w13, call.w2, call.topk_weights, call.topk_ids, call.activation,
        w13_bias=call.w13_bias, w2_bias=call.w2_bias, w13_lora_a=call.w13_lora_a, w13_lora_b=call.w13_lora_b,
        w2_lora_a=call.w2_lora_a, w2_lora_b=call.w2_lora_b, adapter_enabled=call.adapter_enabled,
        token_lora_mapping=call.token_lora_mapping, expert_map=call.expert_map,
        apply_router_weight_on_input=call.apply_router_weight_on_input, fully_sharded=call.fully_sharded,
        tp_rank=call.tp_rank, lora_collective=call.lora_collective, quant=call.quant, w13_q=call.w13_q,
        w13_scales=call.w13_scales, w2_q=call.w2_q, w2_scales=call.w2_scales, fp8_ops=fp8_ops)


BACKEND = BackendSpec(
    name="eager",
    description="pure-PyTorch eager op and experts (one-shot rounding points, loops over (LoRA, expert) groups)",
    capabilities=Capabilities(levels=frozenset({"op", "expert"}), tensor_parallel=True,
                              activations=frozenset(eager_experts.SUPPORTED),
                              quant=frozenset({"none", *eager_fp8.GROUPS})),
    op=eager.fused_moe_lora,
    experts=run_experts,
    precision="one_shot",
    # on the CPU its GEMMs accumulate in fp32 and round once, where one_shot rounds; cuBLAS may reduce bf16 partial
    # sums in reduced precision (other rounding points), so not on CUDA
    model_points_only={"cpu": True},
)
