"""The judge computes an emulation's value without its magnitudes (they are never read: a kernel is judged
with the truth's): the value is bit for bit the one the full computation gives, on drawn op, expert
(TP, fully-sharded, EP) and dispatched-EP cases, in every path's rounding."""
from __future__ import annotations

import pytest
import torch

from moe_lora_harness.harness.build.builders import build_op_inputs, torch_dtype
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.build.expert_runner import expert_expectations
from moe_lora_harness.harness.judge.expectation import op_reference
from moe_lora_harness.harness.draw.strategies import ep_cases, examples, expert_cases, op_cases
from moe_lora_harness.op_contract.validate import validate_call
from moe_lora_harness.reference.experts import moe_experts_forward
from moe_lora_harness.reference.lora_op import fused_moe_lora_expected
from moe_lora_harness.reference.precision import precision
from moe_lora_harness.reference.sharding import sharded_experts_forward

OP_PATHS = ("one_shot", "two_kernel", "small_batch")


def _full_emulation_op(case, cpu, name):
    return fused_moe_lora_expected(validate_call(**cpu.call_kwargs()), precision=precision(name, torch_dtype(case)))


@pytest.mark.parametrize("path", OP_PATHS)
def test_op_emulation_value_equals_the_full_computation(path):
    cases = examples(op_cases(max_T=12, max_dim=48), 12, seed=5)
    assert any(c.fully_sharded for c in cases) and any(not c.add_inputs for c in cases)
    for case in cases:
        cpu = build_op_inputs(case, "cpu")
        got = op_reference(case, cpu, path)
        want = _full_emulation_op(case, cpu, path)
        assert got.scale is None and got.underflow is None
        assert torch.equal(got.written, want.written), case.to_json()
        assert torch.equal(got.value, want.value), case.to_json()


def _full_emulation_expert(case, name):
    """What expert_expectations' emulation was before it skipped the magnitudes: the same forward, full."""
    import moe_lora_harness.harness.build.expert_runner as er
    real = {"moe": er.moe_experts_forward, "sharded": er.sharded_experts_forward}
    er.moe_experts_forward = lambda *a, magnitudes=True, **k: moe_experts_forward(*a, **k)
    er.sharded_experts_forward = lambda *a, magnitudes=True, **k: sharded_experts_forward(*a, **k)
    try:
        return expert_expectations(case, name, emulation_only=True)[2]
    finally:
        er.moe_experts_forward, er.sharded_experts_forward = real["moe"], real["sharded"]


# the branches a draw of 16 may miss: fully-sharded TP LoRA (the joins), EP with LoRA, the interleaved
# gated activation's split delta, the router weight on the input, biases
FIXED = [Case(level="expert", T=6, H=16, I=8, E=4, top_k=2, max_loras=2, max_rank=4, seed=1, tp_size=2,
              fully_sharded=True, bias=True),
         Case(level="expert", T=6, H=16, I=8, E=4, top_k=2, max_loras=2, max_rank=4, seed=2, tp_size=2),
         Case(level="expert", T=7, H=16, I=8, E=4, top_k=2, max_loras=2, max_rank=4, seed=3, ep_size=2, ep_rank=1),
         Case(level="expert", T=5, H=16, I=8, E=4, top_k=2, max_loras=2, max_rank=4, seed=4, activation="swigluoai",
              bias=True),
         Case(level="expert", T=5, H=16, I=8, E=4, top_k=1, max_loras=2, max_rank=4, seed=5,
              apply_router_weight_on_input=True)]


@pytest.mark.parametrize("draw", ["fixed", "expert", "ep"])
def test_expert_emulation_value_equals_the_full_computation(draw):
    cases = (FIXED if draw == "fixed" else
             examples(expert_cases(max_T=10, max_dim=32) if draw == "expert" else ep_cases(max_T=10, max_dim=32),
                      16, seed=5))
    for case in cases:
        assert not case.problems(), case.problems()
        _, _, got = expert_expectations(case, "one_shot", emulation_only=True)
        want = _full_emulation_expert(case, "one_shot")
        assert got.scale is None and got.underflow is None and want.scale is not None
        assert torch.equal(got.value, want.value), case.to_json()
