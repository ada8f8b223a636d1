"""An example moe-lora-harness backend: vLLM 0.33.0's `fused_moe_lora`, naive layout, in plain PyTorch.

Two parts, the way every backend has them:
  1. `fused_moe_lora`: the op, with vLLM 0.33.0's signature, writing into `output` in place.
  2. `SPEC`: a `BackendSpec` declaring what the op supports. The harness runs only the cases the spec
     claims and reports every other one as unsupported with the reason given here, so declare honestly:
     a claimed case that fails is a failure, and `--probe-unsupported` reports declined ones that pass.

pyproject.toml registers `SPEC` under the entry-point group `moe_lora_harness.backends`; after
`pip install`, `moe-lora-harness check --only example_op` finds it with no `--backend` flag.
"""
from __future__ import annotations

import torch

from moe_lora_harness import BackendSpec, Capabilities

MAX_RANK = 64


def fused_moe_lora(output, qcurr_hidden_states, lora_a_stacked, lora_b_stacked, topk_weights,
                   sorted_token_ids, expert_ids, num_tokens_post_padded, token_lora_mapping, max_lora_rank,
                   top_k_num, lora_ids, num_active_loras, adapter_enabled,
                   shrink_block_size_m=16, shrink_block_size_n=64, shrink_block_size_k=32,
                   shrink_group_size_m=8, shrink_num_warps=4, shrink_num_stages=3, shrink_split_k=1,
                   expand_block_size_m=16, expand_block_size_n=64, expand_block_size_k=32,
                   expand_group_size_m=8, expand_num_warps=4, expand_num_stages=3, expand_split_k=1,
                   mul_routed_weight=False, fully_sharded=False, offset=0, add_inputs=True):
    """In place, for each (token t, slot j) pair p = t*k + j with an enabled LoRA l and expert e:

        u = rnd(A_s[l, e] @ x_row)                   shrink: fp32 accumulate, rounded to the working dtype
        d = rnd(w_p * (B_s[l, e] @ u))               expand: fp32, routing weight only if mul_routed_weight
        output[t, j, offset + s*N : offset + (s+1)*N]  = rnd(out + d) if add_inputs else d

    for every slice s. x_row is x[p] with mul_routed_weight (x has T*k rows) and x[p // k] without (T rows).
    Those three roundings are the "one_shot" precision preset the spec declares. The tuning ints only
    shape a GPU launch; a plain-PyTorch op ignores them. Naive layout only: lora_ids / num_active_loras
    select LoRAs for the sorted layout and are not needed here.
    """
    if sorted_token_ids is not None or fully_sharded or max_lora_rank > MAX_RANK:
        raise NotImplementedError("example op: naive layout, rank <= 64, not fully_sharded only")
    T, k = topk_weights.shape
    dt = output.dtype
    num_loras = lora_a_stacked[0].shape[0]

    # Which pairs get a delta: the pair's token must map to a LoRA slot in [0, L) that is enabled
    # (token_lora_mapping -1 = no LoRA; adapter_enabled[l] == 0 = slot disabled), and its expert be >= 0.
    pair = torch.arange(T * k, device=output.device)
    lora = token_lora_mapping.long()[pair // k]
    expert = expert_ids.reshape(-1).long()[: T * k]
    enabled = adapter_enabled.long().to(output.device)
    ok = (lora >= 0) & (lora < num_loras) & (expert >= 0)
    ok &= enabled[lora.clamp(0, num_loras - 1)] != 0

    x = qcurr_hidden_states
    flat = output.view(T * k, output.shape[-1])      # one row per pair; writes land in `output`
    w = topk_weights.reshape(-1).float()
    # One small GEMM per (lora, expert) group of pairs.
    for l, e in torch.stack([lora[ok], expert[ok]], 1).unique(dim=0).tolist():
        rows = pair[ok & (lora == l) & (expert == e)]
        x_rows = x[rows if mul_routed_weight else rows // k].float()
        for s, (A, B) in enumerate(zip(lora_a_stacked, lora_b_stacked)):
            a = A[l, e if A.shape[1] > 1 else 0].float()     # (R, K); expert dim 1 = shared across experts
            b = B[l, e if B.shape[1] > 1 else 0].float()     # (N, R)
            u = (x_rows @ a.t()).to(dt)                      # rounding 1: the rank intermediate
            d = u.float() @ b.t()
            if mul_routed_weight:
                d = d * w[rows, None]
            d = d.to(dt)                                     # rounding 2: the delta
            cols = slice(offset + s * b.shape[0], offset + (s + 1) * b.shape[0])
            if add_inputs:
                flat[rows, cols] = (flat[rows, cols].float() + d.float()).to(dt)   # rounding 3: the add
            else:
                flat[rows, cols] = d


SPEC = BackendSpec(
    name="example_op",
    description="example third-party backend: plain-PyTorch fused_moe_lora (naive layout, rank <= 64)",
    capabilities=Capabilities(
        levels=frozenset({"op"}),
        layouts=frozenset({"naive"}),
        max_rank=MAX_RANK,
        fully_sharded=False,
        dtypes={"cpu": frozenset({"float16", "float32"}),
                "cuda": frozenset({"float16", "bfloat16", "float32"})},
        # every dtype left out of `dtypes` needs its reason: it is printed with each skip
        dtype_reasons={("cpu", "bfloat16"): "kept out of CPU CI for speed (the op itself is dtype-generic)"},
    ),
    op=fused_moe_lora,
    precision="one_shot",   # the reference's model of these rounding points (rank intermediate, delta, add)
    # it rounds there and nowhere else (torch's CPU GEMMs sum in fp32 and round once): declared per device kind, the
    # aggregate rules then allow a flip of those roundings, not one more rounding of every value, and are several
    # times sharper. Not on CUDA, where cuBLAS may sum bf16 partial products in reduced precision (another point)
    model_points_only={"cpu": True},
)
