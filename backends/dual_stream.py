"""Expert-level backend `triton_experts_dual_stream`: TritonExperts with the LoRA deltas on an aux stream.

Same declarations as TritonExperts (the class inherits them), checked by its own is_supported_config.
Rounding model: the dual-stream add, rnd(cache + rnd(delta)), over the LoRA op path the class takes
("dual_stream", or "dual_stream_small_batch" when the delta comes from the small-batch kernel); with a
fully-sharded LoRA, or a batch above the context's dual_stream_max_tokens (default 128), the class runs on
one stream and follows that path's own preset. One experts object
per configuration is kept, so the aux stream and events are created once, as a layer would.
On the CPU every call also runs the Recorder's race check (a race raises, failing the case), and a case whose
gate is closed (no LoRA, or a fully-sharded one) is declined there: it would run TritonExperts' own path.
"""
from __future__ import annotations

from moe_lora_harness.backends.experts import (
    apply_experts, capabilities_of, config_from_call, context_from_call, precision_for, prepare_finalize_for,
    unavailable,
)
import dataclasses

from moe_lora_harness.backends.rounding import TRITON_FP8_MMA, TRITON_POINTS_ONLY
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.contract import BackendSpec, Rule

try:
    import triton  # noqa: F401
    from moe_lora_harness.kernels.experts.dual_stream_experts import DualStreamTritonExperts
    _IMPORT_ERROR = ""
except Exception as e:  # noqa: BLE001 - declared, not hidden: every case reports this reason
    DualStreamTritonExperts = None
    _IMPORT_ERROR = f"dual-stream experts not importable: {type(e).__name__}: {e}"

_LAYERS: dict = {}   # MoEConfig -> DualStreamTritonExperts (one "layer" per configuration)


def dual_stream_precision(case: Case) -> str:
    """Reference preset: the dual-stream add over the LoRA op path the experts take for this case."""
    path = precision_for(DualStreamTritonExperts)(case)   # one_shot without LoRA
    if not case.lora or not DualStreamTritonExperts.dual_stream_applies(case.fully_sharded, case.T):
        return path                        # one stream: the path's own rounding
    return "dual_stream_small_batch" if path == "small_batch" else "dual_stream"


def gate_open(case: Case) -> bool:
    """Whether the class runs the case on two streams (else it is plain TritonExperts: super().apply)."""
    return case.lora and DualStreamTritonExperts.dual_stream_applies(case.fully_sharded, case.T)


GATE_CLOSED_ON_CPU = Rule(
    "dual-stream gate open", gate_open,
    "adds nothing on the CPU: without LoRA, or with a fully-sharded one, the gate is closed and the class runs "
    "TritonExperts' own path, which triton_experts' row of this case runs (on a GPU every case still runs)",
    devices=frozenset({"cpu"}))


def run_experts(call) -> None:
    """ExpertCall -> FusedMoEKernel(no-EP prepare/finalize, this config's dual-stream experts), dual_stream on."""
    pf_and_map = prepare_finalize_for(call)   # the layer's construction checks (EP) first
    config = config_from_call(call)
    experts = _LAYERS.get(config)
    if experts is None:
        experts = _LAYERS[config] = DualStreamTritonExperts(config)
    ctx = context_from_call(call, config)
    if ctx is not None:
        ctx.dual_stream = True
    apply_experts(call, experts, ctx, pf_and_map)


if DualStreamTritonExperts is not None:
    BACKEND = BackendSpec(
        name="triton_experts_dual_stream",
        description="Triton experts with LoRA deltas on an aux stream (add_inputs=False into zeroed buffers, "
                    "joined by events, added on main; spec 5 dual-stream mode)",
        capabilities=dataclasses.replace(capabilities_of(DualStreamTritonExperts),
                                         rules=capabilities_of(DualStreamTritonExperts).rules + (GATE_CLOSED_ON_CPU,)),
        experts=run_experts,
        precision=dual_stream_precision, model_points_only=TRITON_POINTS_ONLY, fp8_mma=TRITON_FP8_MMA,
        cpu_rows_in_full_tier="triton_experts' kernels on one stream in the CPU interpreter (the schedule: suites/schedule)",
    )
else:
    BACKEND = unavailable("triton_experts_dual_stream", _IMPORT_ERROR)
