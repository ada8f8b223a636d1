"""Our op as a drop-in for vLLM 0.33.0's fused_moe_lora: the tuning ints of its signature are the one
tuple op_contract.validate.TUNING_PARAMS names, at vLLM's positions, in every entry point we ship; and its
argument errors are AssertionErrors (what vLLM's asserts raise, and its tests expect) as well as ValueErrors."""
from __future__ import annotations

import inspect

import pytest
import torch

from moe_lora_harness.harness.build.builders import build_op_inputs
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.kernels import eager
from moe_lora_harness.kernels.triton import lora_op
from moe_lora_harness.op_contract.call import MoELoRAArgumentError
from moe_lora_harness.op_contract.validate import TUNING_PARAMS

ENTRY_POINTS = {"eager": eager.fused_moe_lora, "triton": lora_op.fused_moe_lora,
                **{f"triton_{p}": fn for p, fn in lora_op.ENTRY_POINTS.items()}}


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_tuning_params_are_the_signatures_tuning_ints(name):
    params = list(inspect.signature(ENTRY_POINTS[name]).parameters)
    assert params[13] == "adapter_enabled" and tuple(params[14:28]) == TUNING_PARAMS
    assert params[28:32] == ["mul_routed_weight", "fully_sharded", "offset", "add_inputs"]


# --- argument errors: vLLM asserts, so ours are AssertionErrors as well as ValueErrors -------------------------

SORTED = Case(T=4, H=32, I=24, E=4, top_k=2, max_loras=2, max_rank=8, dtype="float16", seed=3)


def raised_by(fn, **changes) -> BaseException:
    """Call `fn` on SORTED's inputs with `changes`; the exception it raised (output must be untouched)."""
    kw = dict(build_op_inputs(SORTED, "cpu").call_kwargs(), **changes)
    before = kw["output"].clone()
    with pytest.raises(Exception) as info:
        fn(**kw)
    assert torch.equal(kw["output"].view(torch.uint8), before.view(torch.uint8)), "output written before the error"
    return info.value


def test_the_argument_error_is_a_value_error_and_an_assertion_error():
    assert issubclass(MoELoRAArgumentError, ValueError) and issubclass(MoELoRAArgumentError, AssertionError)
    assert MoELoRAArgumentError.__doc__ and "AssertionError" in MoELoRAArgumentError.__doc__


@pytest.mark.parametrize("block_m", [8, 24, 48, 0])
def test_bad_sorted_block_m_is_an_assertion_error_naming_shrink_block_size_m(block_m):
    """vLLM's own test: a sorted-layout BLOCK_M that is not a power of two >= 16 raises an AssertionError
    whose message mentions shrink_block_size_m."""
    err = raised_by(lora_op.fused_moe_lora, shrink_block_size_m=block_m)
    assert isinstance(err, AssertionError) and isinstance(err, ValueError), repr(err)
    assert "shrink_block_size_m" in str(err)


@pytest.mark.parametrize("fn,changes,names", [
    (lora_op.fused_moe_lora, dict(max_lora_rank=9), "max_lora_rank"),
    (lora_op.fused_moe_lora, dict(offset=-1), "offset"),
    (lora_op.fused_moe_lora_small_batch, {}, "naive layout"),             # a path that cannot take the call
    (lora_op.fused_moe_lora, dict(sorted_token_ids=None, num_tokens_post_padded=None), "naive mode"),
    (eager.fused_moe_lora, dict(max_lora_rank=9), "max_lora_rank"),
], ids=["rank", "offset", "path", "naive-ids", "eager"])
def test_every_argument_error_is_both(fn, changes, names):
    err = raised_by(fn, **changes)
    assert isinstance(err, MoELoRAArgumentError), repr(err)
    assert names in str(err)


def test_an_id_out_of_range_is_both():
    naive = build_op_inputs(SORTED.replace(layout="naive"), "cpu").call_kwargs()
    naive["expert_ids"] = torch.full_like(naive["expert_ids"], 99)
    with pytest.raises(AssertionError, match="expert_ids") as info:
        lora_op.fused_moe_lora(**naive)
    assert isinstance(info.value, ValueError)


def test_a_wrong_type_stays_a_type_error():
    kw = build_op_inputs(SORTED, "cpu").call_kwargs()
    with pytest.raises(TypeError, match="token_lora_mapping") as info:
        lora_op.fused_moe_lora(**dict(kw, token_lora_mapping=kw["token_lora_mapping"].long()))
    assert not isinstance(info.value, AssertionError)
