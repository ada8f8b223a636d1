"""Expert backends written as strangers write them, for rule 4's default allowance (docs/error-model.md, "The
excess over the emulation"): neither declares `model_points_only`.

`transformers_style`: a correct eager MoE that rounds at every torch op, as Hugging Face transformers' MoE blocks do
(GEMM2's output rounded before the routing weight, the weight itself rounded to the working dtype, the k expert
outputs summed into a working-dtype buffer one expert at a time): more rounding points than vLLM's, each of them
harmless; the judge must pass it. `accumulates_in_working_dtype(tile)`: the eager pipeline with a precision bug, each
base GEMM's accumulator kept in the working dtype between K tiles (`acc = tl.zeros(..., dtype=out.dtype)`), which
vLLM's own assert_close fails at H 1024 already; the judge must fail it.
"""
from __future__ import annotations

import torch

from moe_lora_harness.harness.spec.contract import BackendSpec, Capabilities, Rule
from moe_lora_harness.kernels import eager_experts
from moe_lora_harness.kernels.eager import fused_moe_lora
from moe_lora_harness.op_contract.validate import default_tuning

GATED = frozenset({"silu", "gelu", "gelu_tanh"})
_RULES = (Rule("weight on output", lambda case: not case.apply_router_weight_on_input,
               "the routing weight multiplies the expert's output (a transformers MoE block), never its input"),)


def _gemm(x: torch.Tensor, w: torch.Tensor, tile: int | None) -> torch.Tensor:
    """x @ w^T in fp32, rounded to x's dtype; `tile`: the accumulator rounded to it after every `tile` of K too."""
    dt = x.dtype
    if tile is None:
        return (x.float() @ w.float().t()).to(dt)
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=dt, device=x.device)
    for k0 in range(0, x.shape[1], tile):
        acc = (acc.float() + x[:, k0:k0 + tile].float() @ w[:, k0:k0 + tile].float().t()).to(dt)
    return acc


def _forward(call, *, tile: int | None, transformers: bool) -> None:
    x, ids = call.hidden_states, call.topk_ids.long()
    T, H = x.shape
    k, dt = ids.shape[1], x.dtype
    flat = ids.reshape(-1)
    N1 = call.w13.shape[1]
    cache1 = torch.zeros(T * k, N1, dtype=dt, device=x.device)
    for e in torch.unique(flat).tolist():
        rows = (flat == e).nonzero().squeeze(1)
        cache1[rows] = _gemm(x[rows // k], call.w13[e], tile)
    args = None
    if call.w13_lora_a is not None:
        L = call.w13_lora_a[0].shape[0]
        m = call.token_lora_mapping
        lora_ids = torch.cat([torch.unique(m), torch.full((L + 1,), -1, dtype=torch.int32, device=x.device)])[:L + 1]
        args = dict(topk_weights=call.topk_weights, sorted_token_ids=None, expert_ids=flat.to(torch.int32),
                    num_tokens_post_padded=None, token_lora_mapping=m, top_k_num=k, lora_ids=lora_ids.to(torch.int32),
                    num_active_loras=torch.tensor([L + 1], dtype=torch.int32), adapter_enabled=call.adapter_enabled,
                    **default_tuning(16), fully_sharded=False)
        fused_moe_lora(cache1.view(T, k, N1), x, call.w13_lora_a, call.w13_lora_b, **args, mul_routed_weight=False,
                       max_lora_rank=int(call.w13_lora_a[0].shape[2]))
    a = eager_experts.activation(cache1, call.activation)
    weights = call.topk_weights.to(dt).float() if transformers else call.topk_weights.float()
    cache3 = torch.zeros(T * k, H, dtype=dt, device=x.device)
    for e in torch.unique(flat).tolist():
        rows = (flat == e).nonzero().squeeze(1)
        w = weights.reshape(-1)[rows].unsqueeze(1)     # the expert's output rounded, then times the weight
        cache3[rows] = (_gemm(a[rows], call.w2[e], tile).float() * w).to(dt)
    if args is not None:
        fused_moe_lora(cache3.view(T, k, H), a, call.w2_lora_a, call.w2_lora_b, **args, mul_routed_weight=True,
                       max_lora_rank=int(call.w2_lora_a[0].shape[2]))
    c3 = cache3.view(T, k, H)
    if transformers:         # index_add_ into a dt buffer, one expert after another (ascending expert id)
        out = torch.zeros(T, H, dtype=dt, device=x.device)
        order = torch.argsort(ids, dim=1)
        rows = torch.arange(T, device=x.device)
        for j in range(k):
            out = (out.float() + c3[rows, order[:, j]].float()).to(dt)
    else:
        out = c3.float().sum(dim=1).to(dt)
    call.output.copy_(out)


def _spec(name: str, doc: str, **kw) -> BackendSpec:
    return BackendSpec(
        name=name, description=doc,
        capabilities=Capabilities(levels=frozenset({"expert"}), activations=GATED, non_gated=False, bias=False,
                                  expert_map=False, fully_sharded=False, rules=_RULES),
        experts=lambda call: _forward(call, **kw), precision="one_shot")


TRANSFORMERS_STYLE = _spec("transformers_style_experts",
                           "a correct eager MoE rounding at every torch op (Hugging Face transformers' MoE blocks)",
                           tile=None, transformers=True)


def accumulates_in_working_dtype(tile: int = 64) -> BackendSpec:
    """The eager pipeline whose base GEMMs keep their accumulator in the working dtype between K tiles of `tile`."""
    return _spec(f"working_dtype_accumulator_{tile}",
                 f"base GEMMs accumulated in the working dtype per K tile of {tile} (a precision bug)",
                 tile=tile, transformers=False)


BACKENDS = [TRANSFORMERS_STYLE, accumulates_in_working_dtype(64)]
