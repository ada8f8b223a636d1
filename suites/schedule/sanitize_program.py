"""The program ci/sanitize.sh runs under compute-sanitizer (test-only; CUDA): a small dual-stream expert
forward (Triton experts, LoRA deltas on the aux stream).

Two dual-stream calls of one layer must equal a single-stream run bit for bit, and the layer must have
created one aux stream and four events; then it prints MARKER (its one argument) and a checksum, the line
ci/sanitize_verdict.sh requires of a run that completed.
    usage: python -m moe_lora_harness.suites.schedule.sanitize_program MARKER
"""
from __future__ import annotations

import sys

import torch


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    marker, = args

    from moe_lora_harness.backends.experts import config_from_call, context_from_call
    from moe_lora_harness.harness.build.builders import build_expert_inputs
    from moe_lora_harness.harness.spec.case import Case
    from moe_lora_harness.kernels.experts.dual_stream_experts import DualStreamTritonExperts
    from moe_lora_harness.kernels.experts.modular import FusedMoEKernel
    from moe_lora_harness.kernels.experts.prepare_finalize import NoEPPrepareAndFinalize
    from moe_lora_harness.kernels.schedule.cuda import CudaSchedule

    assert torch.cuda.is_available(), "no CUDA device"
    case = Case(level="expert", T=24, H=128, I=128, E=4, top_k=2, max_loras=2, max_rank=16, mapping="mixed",
                dtype="bfloat16", activation="silu", seed=3)
    call = build_expert_inputs(case).call("cuda")
    config = config_from_call(call)

    def forward(experts, single):
        ctx = context_from_call(call, config)
        ctx.dual_stream = True
        if single:
            experts.dual_stream_schedule = CudaSchedule(single_stream=True)
        out = torch.empty_like(call.output)
        FusedMoEKernel(NoEPPrepareAndFinalize(), experts).apply(
            call.hidden_states, call.w13, call.w2, call.topk_weights, call.topk_ids, lora_ctx=ctx,
            expert_map=call.expert_map, w13_bias=call.w13_bias, w2_bias=call.w2_bias, output=out)
        torch.cuda.synchronize()
        return out

    layer = DualStreamTritonExperts(config)
    dual = [forward(layer, single=False) for _ in range(2)]
    ref = forward(DualStreamTritonExperts(config), single=True)
    sched = layer.dual_stream_schedule
    assert isinstance(sched, CudaSchedule) and (sched.created_streams, sched.created_events) == (1, 4)
    for d in dual:
        assert torch.equal(d.view(torch.int16), ref.view(torch.int16)), "dual-stream result differs from single stream"
    assert not bool(ref.isnan().any())
    print(marker, float(ref.float().abs().sum()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
