"""A random, non-trivial MoE layer with packed multi-LoRA, shared by the reference test modules."""

import torch

from moe_lora_harness.reference.adapters import ExpertAdapter, pack_moe_lora
from moe_lora_harness.reference.experts import LoRAInputs

MAPPING_CYCLE = (0, 1, -1, 2, 1, 0)  # token i's slot: two adapters, a token without one, the empty slot


def random_layer(seed, *, T, H, I, E, k, L, max_rank, ranks, gated=True, dtype=torch.float32, bias=False,
                 shared=False, scaling=0.5):
    """(layer kwargs of moe_experts_forward, LoRAInputs): one adapter per rank in `ranks` in slots 0.., then
    an empty (disabled) slot; tokens cycle through MAPPING_CYCLE."""
    g = torch.Generator().manual_seed(seed)
    n1 = 2 * I if gated else I
    layer = dict(
        hidden=torch.randn(T, H, generator=g).to(dtype),
        w13=(torch.randn(E, n1, H, generator=g) / H**0.5).to(dtype),
        w2=(torch.randn(E, H, I, generator=g) / I**0.5).to(dtype),
        topk_weights=torch.rand(T, k, generator=g) * 0.9 + 0.1,
        topk_ids=torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32),
    )
    if bias:
        layer["w13_bias"] = (torch.randn(E, n1, generator=g) * 0.3).to(dtype)
        layer["w2_bias"] = (torch.randn(E, H, generator=g) * 0.3).to(dtype)
    adapters = [ExpertAdapter.random(E, H, I, r, gated, scaling, g) for r in ranks] + [None]
    stacked = pack_moe_lora(adapters, max_loras=L, max_rank=max_rank, num_experts=E, hidden_size=H,
                            intermediate_size=I, dtype=dtype, gated=gated, shared_a=shared, shared_b=shared)
    mapping = torch.tensor([MAPPING_CYCLE[i % len(MAPPING_CYCLE)] for i in range(T)], dtype=torch.int32)
    return layer, LoRAInputs(stacked, mapping)
