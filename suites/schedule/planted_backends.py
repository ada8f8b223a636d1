"""The planted schedule bugs as harness backends: DualStreamTritonExperts with one bug in its program each
(`schedule-control` has none). On the CPU every call runs through the Recorder, so a race raises a
ScheduleError naming the buffer; `not_zeroed` is race-free and must fail the value comparison. Used by
suites/schedule/test_planted_bugs.py and by `moe-lora-harness selftest` (corpus "schedule")."""
from __future__ import annotations

from moe_lora_harness.backends.dual_stream import dual_stream_precision
from moe_lora_harness.backends.experts import config_from_call, context_from_call
from moe_lora_harness.harness.spec.contract import BackendSpec, Capabilities
from moe_lora_harness.kernels.experts.dual_stream import dual_stream_program
from moe_lora_harness.kernels.experts.dual_stream_experts import DualStreamTritonExperts
from moe_lora_harness.kernels.experts.modular import FusedMoEKernel
from moe_lora_harness.kernels.experts.prepare_finalize import NoEPPrepareAndFinalize
from moe_lora_harness.suites.schedule.planted_schedules import PLANTED
from moe_lora_harness.suites.schedule.stand_in import POISON


def planted_backend(bug: str | None) -> BackendSpec:
    """A harness backend running DualStreamTritonExperts with `bug` planted in its program (None = correct)."""
    def run(call):
        config = config_from_call(call)
        experts = DualStreamTritonExperts(config)
        experts.poison_workspace = POISON
        if bug is not None:
            experts.program_for = lambda plan: PLANTED[bug](dual_stream_program(plan))
        ctx = context_from_call(call, config)
        if ctx is not None:
            ctx.dual_stream = True
        kernel = FusedMoEKernel(NoEPPrepareAndFinalize(), experts)
        for _ in range(2):   # two calls of one layer: cross-call reuse is checked too
            kernel.apply(call.hidden_states, call.w13, call.w2, call.topk_weights, call.topk_ids, lora_ctx=ctx,
                         expert_map=call.expert_map, w13_bias=call.w13_bias, w2_bias=call.w2_bias,
                         output=call.output)
    doc = PLANTED[bug].__doc__.strip() if bug else "no planted bug: the dual-stream program as shipped"
    return BackendSpec(name=f"schedule-{bug or 'control'}", description=doc, experts=run,
                       precision=dual_stream_precision,
                       capabilities=Capabilities(levels=frozenset({"expert"}), devices=frozenset({"cpu"}),
                                                 dtypes={"cpu": frozenset({"float16", "float32"})},
                                                 activations=frozenset({"silu"}), bias=False, quant=frozenset({"none"})))


BACKENDS = [planted_backend(None)] + [planted_backend(b) for b in PLANTED]
