"""load_adapter of the layer-level backends with an adapter whose w13 and w2 differ in rank and scaling (PEFT's
conversion of per-expert adapters): each module's own rank and scaling land where they must, checked bit for bit
against equivalent single-rank, unit-scaling adapters (powers of two make the folded scalings exact)."""
from __future__ import annotations

import dataclasses
import pathlib
import sys

import pytest
import torch

from moe_lora_harness.harness.spec.layer_contract import LayerConfig
from moe_lora_harness.harness.build.layer_scenario import Scenario, base_weights
from moe_lora_harness.harness.build.layer_scenario import batch as scenario_batch
from moe_lora_harness.reference.adapters import ExpertAdapter

CONFIG = LayerConfig(H=16, I=16, E=4, top_k=2, dtype="float32", max_loras=2, max_rank=8, max_tokens=8)
_EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "vllm_style_layer" / "src"


def _ours(config, weights):
    from moe_lora_harness.backends.layer import LAYER_TRITON
    return LAYER_TRITON.layer(config, weights)


def _example(config, weights):
    if str(_EXAMPLE) not in sys.path:
        sys.path.insert(0, str(_EXAMPLE))
    from vllm_style_layer.harness_adapter import make_layer
    return make_layer(config, weights)


LAYERS = {"layer_triton": _ours} | ({"vllm_style_layer": _example} if _EXAMPLE.is_dir() else {})


def _pad_rank(t: torch.Tensor, dim: int, r: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = r - shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


@pytest.mark.parametrize("name", list(LAYERS))
def test_per_module_rank_and_scaling_load(name, device):
    c = dataclasses.replace(CONFIG, device=device)
    weights = base_weights(Scenario(CONFIG), device)
    b = scenario_batch(c, {"mapping": [0] * 6, "seed": 3}, device)
    mapping = torch.zeros(6, dtype=torch.int32, device=device)
    mixed = ExpertAdapter.random(c.E, c.H, c.I, 6, True, 0.5, torch.Generator().manual_seed(1),
                                 down_rank=3, down_scaling=4.0)

    def out(adapter: ExpertAdapter) -> torch.Tensor:
        layer = LAYERS[name](c, weights)
        layer.load_adapter(0, adapter)
        layer.set_mapping(mapping)
        return layer.forward(b)

    got = out(mixed)
    # the same adapter with down padded to rank 6 by zeros, and with both scalings folded into B beforehand
    padded = dataclasses.replace(mixed, down_a=_pad_rank(mixed.down_a, 1, 6), down_b=_pad_rank(mixed.down_b, 2, 6))
    folded = dataclasses.replace(mixed, gate_b=mixed.gate_b * 0.5, up_b=mixed.up_b * 0.5, down_b=mixed.down_b * 4.0,
                                 scaling=1.0, down_scaling=None)
    assert torch.equal(got, out(padded))
    assert torch.equal(got, out(folded))
    # the w2 scaling is its own: the adapter with w13's scaling on w2 gives another output
    assert not torch.equal(got, out(dataclasses.replace(mixed, down_scaling=None)))
