"""An expert backend that misbehaves inside one EP or TP rank's call: our triton_experts' correct call, then one
element stored past the rank's output (a store without its tail mask). Loadable by reference, so that EP ranks run
as processes load it too: `moe_lora_harness.suites.harness.rank_hostile_backends:RANK_HOSTILE`."""
from __future__ import annotations

import dataclasses

from moe_lora_harness.harness.spec.registry import available_backends


def _writes_past_rank_output(call):
    available_backends()["triton_experts"].experts(call)
    o = call.output
    o.as_strided((o.numel() + 1,), (1,), o.storage_offset())[-1] = 0.0


RANK_HOSTILE = dataclasses.replace(available_backends()["triton_experts"], name="writes-past-rank-output",
                                   description="triton_experts, then one element stored past the rank's output",
                                   experts=_writes_past_rank_output)
