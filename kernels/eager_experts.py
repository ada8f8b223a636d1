"""Pure-PyTorch eager MoE experts with LoRA (spec 5), in the working dtype, no Triton.

The pipeline production uses: w13 GEMM (+bias), w13 LoRA delta per slice, activation, w2 GEMM (+bias)
with the routed weight folded in before the single rounding, weighted w2 LoRA delta, moe_sum in fp32.
LoRA goes through `kernels.eager.fused_moe_lora` (naive layout). Written independently of reference/.
FP8 schemes (`quant` in eager_fp8.GROUPS): both base GEMMs read the dynamically quantized activation, the LoRA
deltas the unquantized one (docs/semantics.md 9.1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_lora_harness.kernels import eager_fp8
from moe_lora_harness.kernels.eager import fused_moe_lora
from moe_lora_harness.op_contract.validate import default_tuning

OAI_ALPHA, OAI_LIMIT = 1.702, 7.0
SITU_BETA, SITU_LINEAR_BETA = 4.0, 25.0


# act(gate) * up, and the same function alone as `<name>_no_mul`
_ACT_AND_MUL = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}


def _gated(name, g, u, dt):
    """Gated activations on fp32 g, u with the production rounding points."""
    if name in _ACT_AND_MUL:
        return (_ACT_AND_MUL[name](g).to(dt).float() * u).to(dt)   # act(gate) rounded before the product
    if name in ("swigluoai", "swigluoai_uninterleave"):
        g = g.clamp(max=OAI_LIMIT)
        u = u.clamp(-OAI_LIMIT, OAI_LIMIT)
        act = g * torch.sigmoid(OAI_ALPHA * g)
        if name == "swigluoai":
            return ((u + 1.0) * act).to(dt)                # one rounding
        return (act.to(dt).float() * (u + 1.0)).to(dt)
    if name == "swiglustep":
        return (F.silu(g).clamp(max=7.0) * u.clamp(-7.0, 7.0)).to(dt)
    if name == "situ":
        gate = SITU_BETA * torch.tanh(g / SITU_BETA) * torch.sigmoid(g)
        up = SITU_LINEAR_BETA * torch.tanh(u / SITU_LINEAR_BETA)
        return (gate * up).to(dt)
    raise ValueError(f"activation {name!r} is not supported by the eager experts")


_NO_MUL = {**{f"{name}_no_mul": f for name, f in _ACT_AND_MUL.items()}, "relu2_no_mul": lambda v: torch.relu(v) ** 2}
SUPPORTED = (*_ACT_AND_MUL, "swigluoai", "swigluoai_uninterleave", "swiglustep", "situ", *_NO_MUL)


def activation(cache1: torch.Tensor, name: str) -> torch.Tensor:
    """(M, N1) dt -> (M, I) dt; swigluoai reads interleaved [g0, u0, g1, u1, ...]."""
    dt = cache1.dtype
    x = cache1.float()
    if name in _NO_MUL:
        return _NO_MUL[name](x).to(dt)
    if name == "swigluoai":
        return _gated(name, x[:, 0::2], x[:, 1::2], dt)
    if name not in SUPPORTED:
        raise ValueError(f"activation {name!r} is not supported; supported: {SUPPORTED}")
    half = x.shape[1] // 2
    return _gated(name, x[:, :half], x[:, half:], dt)


def moe_experts_forward(output, hidden_states, w13, w2, topk_weights, topk_ids, activation_name, *,
                        w13_bias=None, w2_bias=None, w13_lora_a=None, w13_lora_b=None, w2_lora_a=None,
                        w2_lora_b=None, adapter_enabled=None, token_lora_mapping=None, expert_map=None,
                        apply_router_weight_on_input=False, fully_sharded=False, tp_rank=0, lora_collective=None,
                        quant="none", w13_q=None, w13_scales=None, w2_q=None, w2_scales=None,
                        fp8_ops=eager_fp8.FP8_OPS):
    """Writes the (T, H) expert output into `output` (dt) in place.

    quant an FP8 scheme: w13_q/w2_q (e4m3 codes) and their fp32 scales are the base weights (w13/w2 unused);
    `fp8_ops` its steps (eager_fp8.Fp8Ops; a planted bug swaps one). Other schemes: w13/w2 as given.

    fully_sharded (a TP rank's sliced LoRA): the shrink outputs are joined by `lora_collective(cache, which)`
    ("w13" all-gather, "w2" all-reduce; None = no join, one rank) and the w2 delta is written at
    tp_rank * (this rank's H rows of w2 B)."""
    T, H = hidden_states.shape
    k = topk_ids.shape[1]
    dt = hidden_states.dtype
    E, N1, _ = w13.shape
    I = w2.shape[2]
    dev = hidden_states.device
    ids = topk_ids.long()
    local = expert_map.long()[ids] if expert_map is not None else ids
    w = topk_weights.float()
    x_in = hidden_states
    if apply_router_weight_on_input:
        if k != 1:
            raise ValueError(f"apply_router_weight_on_input needs top_k == 1; got topk_ids of shape {tuple(topk_ids.shape)}")
        # vLLM's prepare: a1 * topk_weights.to(a1.dtype) -- the fp32 weight is rounded to dt FIRST, then the
        # dt x dt product (exact in fp32) is rounded once: rnd(x * rnd(w)), not rnd(x * w)
        x_in = (hidden_states.float() * w.to(dt).float()).to(dt)
    flat_local = local.reshape(-1)
    fp8 = quant in eager_fp8.GROUPS
    if fp8:
        if w13_q is None or w13_scales is None or w2_q is None or w2_scales is None:
            raise ValueError(f"quant={quant!r} needs w13_q, w13_scales, w2_q and w2_scales (e4m3 codes and scales)")
        if dt not in (torch.float16, torch.bfloat16):
            raise ValueError(f"quant={quant!r} needs hidden_states in float16 or bfloat16; got {dt}")
        group, wblock = eager_fp8.GROUPS[quant], eager_fp8.WEIGHT_BLOCKS[quant]
        codes1, scales1 = fp8_ops.quantize(x_in, group)       # per token (or token-group), dynamic
    lora_x = fp8_ops.lora_input(hidden_states, codes1) if fp8 else hidden_states
    cache1 = torch.zeros(T * k, N1, dtype=dt, device=dev)
    for e in torch.unique(flat_local[flat_local >= 0]).tolist():
        rows = (flat_local == e).nonzero().squeeze(1)
        if fp8:
            acc = fp8_ops.gemm(codes1[rows // k], scales1[rows // k], w13_q[e], w13_scales[e], wblock)
        else:
            acc = x_in[rows // k].float() @ w13[e].float().t()
        if w13_bias is not None:
            acc = acc + w13_bias[e].float()
        cache1[rows] = acc.to(dt)
    lora = w13_lora_a is not None
    if lora:
        L = w13_lora_a[0].shape[0]
        lora_ids = torch.cat([torch.unique(token_lora_mapping), torch.full((L + 1,), -1, dtype=torch.int32, device=dev)])[:L + 1].to(torch.int32)
        num_active = torch.tensor([L + 1], dtype=torch.int32)
        eids = flat_local.to(torch.int32)
        c1 = cache1.view(T, k, N1)
        args = dict(topk_weights=topk_weights, sorted_token_ids=None, expert_ids=eids,
                    num_tokens_post_padded=None, token_lora_mapping=token_lora_mapping,
                    top_k_num=k, lora_ids=lora_ids, num_active_loras=num_active, adapter_enabled=adapter_enabled,
                    **default_tuning(16), fully_sharded=fully_sharded)

        r13 = int(w13_lora_a[0].shape[2])   # fully_sharded: w13 A holds R/tp rank rows, w2 A all R

        def join(which):
            return {} if lora_collective is None else {"collective": lambda c: lora_collective(c, which)}
        if activation_name == "swigluoai" and len(w13_lora_a) == 2:
            # into zeros with add_inputs=True: rnd(0 + rnd(d)) = rnd(d), and allowed under fully_sharded
            delta = torch.zeros(T, k, N1, dtype=dt, device=dev)
            fused_moe_lora(delta, lora_x, w13_lora_a, w13_lora_b, **args, mul_routed_weight=False,
                           max_lora_rank=r13, **join("w13"))
            c1[..., 0::2] += delta[..., :N1 // 2]
            c1[..., 1::2] += delta[..., N1 // 2:]
        else:
            fused_moe_lora(c1, lora_x, w13_lora_a, w13_lora_b, **args, mul_routed_weight=False,
                           max_lora_rank=r13, **join("w13"))
    cache2 = activation(cache1, activation_name)
    if fp8:
        codes2, scales2 = fp8_ops.quantize(cache2, group)     # per pair row (or row-group), dynamic
    lora_a2 = fp8_ops.lora_input(cache2, codes2) if fp8 else cache2
    cache3 = torch.zeros(T * k, H, dtype=dt, device=dev)
    wf = w.reshape(-1)
    for e in torch.unique(flat_local[flat_local >= 0]).tolist():
        rows = (flat_local == e).nonzero().squeeze(1)
        if fp8:
            acc = fp8_ops.gemm(codes2[rows], scales2[rows], w2_q[e], w2_scales[e], wblock)
        else:
            acc = cache2[rows].float() @ w2[e].float().t()
        if w2_bias is not None:
            acc = acc + w2_bias[e].float()
        if not apply_router_weight_on_input:
            acc = acc * wf[rows].unsqueeze(1)
        cache3[rows] = acc.to(dt)
    if lora:
        offset = int(w2_lora_b[0].shape[2]) * tp_rank if fully_sharded else 0
        fused_moe_lora(cache3.view(T, k, H), lora_a2, w2_lora_a, w2_lora_b, **args, mul_routed_weight=True,
                       max_lora_rank=int(w2_lora_a[0].shape[2]), offset=offset, **join("w2"))
    keep = (flat_local >= 0).view(T, k, 1)
    out = (cache3.view(T, k, H).float() * keep).sum(dim=1)
    output.copy_(out.to(dt))
