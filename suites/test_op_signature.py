"""Every `fused_moe_lora` entry point we ship (the reference's, eager's, Triton's four) has vLLM 0.33.0's
signature from its one definition (op_contract.validate.validate_call), then only keyword-only extras of its
own; a positional call and a keyword call of the same arguments do the same."""
from __future__ import annotations

import inspect

import pytest
import torch

from moe_lora_harness.harness.build.builders import build_op_inputs
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.kernels import eager
from moe_lora_harness.kernels.triton import lora_op
from moe_lora_harness.op_contract.validate import SIGNATURE
from moe_lora_harness.reference import lora_op as reference

ENTRY_POINTS = {"reference": reference.fused_moe_lora, "eager": eager.fused_moe_lora, "triton": lora_op.fused_moe_lora,
                **{f"triton_{p}": fn for p, fn in lora_op.ENTRY_POINTS.items()}}
CASE = Case(T=4, H=32, I=24, E=4, top_k=2, max_loras=2, max_rank=8, dtype="float16", seed=3)


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_the_signature_is_vllms_then_keyword_only_extras(name):
    params = list(inspect.signature(ENTRY_POINTS[name]).parameters.values())
    vllm = list(SIGNATURE.parameters.values())
    assert len(vllm) == 32 and params[:len(vllm)] == vllm
    assert all(p.kind is p.KEYWORD_ONLY for p in params[len(vllm):]), params[len(vllm):]


@pytest.mark.parametrize("name", ["reference", "eager", "triton"])
def test_positional_and_keyword_calls_do_the_same(name, device):
    by_keyword = build_op_inputs(CASE, device).call_kwargs()
    by_position = build_op_inputs(CASE, device).call_kwargs()
    before = by_keyword["output"].clone()
    ENTRY_POINTS[name](**by_keyword)
    ENTRY_POINTS[name](*(by_position[n] for n in SIGNATURE.parameters))
    assert not torch.equal(by_keyword["output"], before), "the call wrote nothing: it could not tell them apart"
    assert torch.equal(by_keyword["output"], by_position["output"])
