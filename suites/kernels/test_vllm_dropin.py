"""Our op as a drop-in for vLLM 0.33.0's fused_moe_lora: the tuning ints of its signature are the one
tuple kernels.validate.TUNING_PARAMS names, at vLLM's positions, in every entry point we ship."""
from __future__ import annotations

import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe_lora_harness.kernels import eager  # noqa: E402
from moe_lora_harness.kernels.triton import lora_op  # noqa: E402
from moe_lora_harness.kernels.validate import TUNING_PARAMS  # noqa: E402

ENTRY_POINTS = {"eager": eager.fused_moe_lora, "triton": lora_op.fused_moe_lora,
                **{f"triton_{p}": fn for p, fn in lora_op.ENTRY_POINTS.items()}}


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_tuning_params_are_the_signatures_tuning_ints(name):
    params = list(inspect.signature(ENTRY_POINTS[name]).parameters)
    assert params[13] == "adapter_enabled" and tuple(params[14:28]) == TUNING_PARAMS
    assert params[28:32] == ["mul_routed_weight", "fully_sharded", "offset", "add_inputs"]
