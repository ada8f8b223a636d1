"""GPU stress for the dual-stream schedule: torch.cuda._sleep injected around launches (aux delayed, main
delayed, random) widens every race window; the correct program must stay bit-identical to the
single-stream run of the same program, and each planted racy bug (and the unzeroed delta) must differ.
Runs only with CUDA (the lead's GPU lane): the Triton experts when importable, else torch stand-ins.
"""
from __future__ import annotations

import pytest
import torch

from moe_lora_harness.harness.build.builders import build_expert_inputs
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.kernels.experts.dual_stream import AUX, EVENTS, dual_stream_program, run_program

from .planted_schedules import PLANTED, RACY
from .sleepy import SleepySchedule
from .stand_in import POISON, TorchPhases, allocate_workspace

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU stress needs a CUDA device")]

CASE = Case(level="expert", T=64, H=256, I=128, E=8, top_k=2, max_loras=3, max_rank=16, mapping="mixed",
            dtype="bfloat16", activation="silu", seed=5)
N_INPUTS = 3          # distinct hidden-state sets, cycled: stale data from the previous call is then wrong
REPS = 12             # per program: 4 rounds of the three sleep modes
CYCLES = 2_000_000    # about 1 ms of spinning per injected sleep on an H200
# The caller's input write is held back longer than the host takes to issue the whole forward (Python and
# eager launches: a few ms). With only CYCLES there, an idle H200 had finished the write before the aux
# stream's first launch was even issued, so a missing input wait never showed (seen 2026-11-29, 4 runs of
# 4 with the file alone; under a busy GPU it did show).
INPUT_CYCLES = 40_000_000  # about 20 ms


class Layer:
    """One expert layer on the GPU with a settable schedule and program (Triton experts or stand-ins)."""

    def __init__(self, case: Case, program_for):
        self.inp = build_expert_inputs(case)
        self.call = self.inp.call("cuda")
        self.hidden = self.call.hidden_states.clone()          # the caller's input buffer, rewritten per call
        self.out = torch.empty_like(self.call.output)
        self.program_for = program_for
        try:
            from moe_lora_harness.backends.experts import config_from_call, context_from_call
            from moe_lora_harness.kernels.experts.dual_stream_experts import DualStreamTritonExperts
            from moe_lora_harness.kernels.experts.modular import FusedMoEKernel
            from moe_lora_harness.kernels.experts.prepare_finalize import NoEPPrepareAndFinalize
        except Exception:  # noqa: BLE001 - fall back to the torch stand-ins
            self.kernel = None
            s = self.inp.stacked
            c = self.call
            dev = lambda t: t.to("cuda")  # noqa: E731
            self.phases = TorchPhases(c.w13, c.w2, c.topk_weights, c.topk_ids,
                                      lora=([dev(t) for t in s.w13_a], [dev(t) for t in s.w13_b], dev(s.w2_a[0]),
                                            dev(s.w2_b[0])),
                                      token_lora_mapping=c.token_lora_mapping, adapter_enabled=c.adapter_enabled)
            self.sched = None
            return
        config = config_from_call(self.call)
        self.experts = DualStreamTritonExperts(config)
        self.experts.poison_workspace = POISON
        self.experts.program_for = lambda plan: self.program_for(plan)
        self.ctx = context_from_call(self.call, config)
        self.ctx.dual_stream = True
        self.kernel = FusedMoEKernel(NoEPPrepareAndFinalize(), self.experts)

    def set_schedule(self, sched):
        if self.kernel is not None:
            self.experts.dual_stream_schedule = sched
        else:
            self.sched = sched

    def __call__(self, src: torch.Tensor, delay_inputs: bool) -> torch.Tensor:
        """Write `src` into the input buffer on the main stream (after a spin when asked), then run the layer."""
        self.hidden.fill_(float("nan"))
        if delay_inputs:
            torch.cuda._sleep(INPUT_CYCLES)
        self.hidden.copy_(src)
        return self.forward()

    def forward(self) -> torch.Tensor:
        """The layer on the current input buffer, into `self.out`."""
        c = self.call
        if self.kernel is not None:
            self.kernel.apply(self.hidden, c.w13, c.w2, c.topk_weights, c.topk_ids, lora_ctx=self.ctx,
                              expert_map=c.expert_map, w13_bias=c.w13_bias, w2_bias=c.w2_bias, output=self.out)
        else:
            b = allocate_workspace(CASE.T, CASE.top_k, 2 * CASE.I, CASE.I, CASE.H, src.dtype, "cuda")
            b.update(hidden=self.hidden, topk_ids=c.topk_ids, topk_weights=c.topk_weights, out=self.out)
            run_program(self.sched, self.program_for("both"), self.phases, b)
        return self.out


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator(device="cuda").manual_seed(1234)
    return [torch.randn(CASE.T, CASE.H, device="cuda", generator=g).to(torch.bfloat16) for _ in range(N_INPUTS)]


@pytest.fixture(scope="module")
def expected(inputs):
    """Single-stream results of the correct program, one per input set."""
    from moe_lora_harness.kernels.schedule.cuda import CudaSchedule
    layer = Layer(CASE, dual_stream_program)
    layer.set_schedule(CudaSchedule(single_stream=True))
    outs = []
    for src in inputs:
        outs.append(layer(src, delay_inputs=False).clone())
    torch.cuda.synchronize()
    assert not any(bool(o.isnan().any()) for o in outs)
    return outs


def stress(program_for, inputs, expected) -> tuple[int, "Layer", object]:
    """Run REPS calls under sleep injection; returns (#results differing from single stream, layer, inner schedule)."""
    from moe_lora_harness.kernels.schedule.cuda import CudaSchedule
    layer = Layer(CASE, program_for)
    inner = CudaSchedule()
    bad = 0
    for rep in range(REPS):
        mode = SleepySchedule.MODES[rep % 3]
        layer.set_schedule(SleepySchedule(inner, mode=mode, cycles=CYCLES, seed=rep))
        i = rep % N_INPUTS
        out = layer(inputs[i], delay_inputs=(mode != "aux"))
        torch.cuda.synchronize()
        if not torch.equal(out.view(torch.int16), expected[i].view(torch.int16)):
            bad += 1
    return bad, layer, inner


@pytest.fixture(autouse=True)
def _no_host_syncs(monkeypatch):
    # the id value-range checks sync the host, which would close the race windows we are widening
    monkeypatch.setenv("MOE_LORA_UNCHECKED", "1")


def test_correct_schedule_is_bit_identical_to_single_stream_under_stress(inputs, expected):
    bad, layer, inner = stress(dual_stream_program, inputs, expected)
    assert bad == 0, f"{bad}/{REPS} dual-stream results differ from the single-stream run"
    assert (inner.created_streams, inner.created_events) == (1, len(EVENTS))
    assert inner.cuda_stream(AUX) is inner.cuda_stream(AUX)


@pytest.mark.parametrize("bug", list(PLANTED))
def test_planted_bug_fails_under_stress(bug, inputs, expected):
    bad, _, _ = stress(lambda plan: PLANTED[bug](dual_stream_program(plan)), inputs, expected)
    kind = "race" if bug in RACY else "value bug"
    assert bad > 0, f"planted {kind} {bug!r} gave {REPS}/{REPS} results identical to the single-stream run"


def test_dual_stream_forward_is_graph_capturable(inputs, expected):
    """Every aux chain starts with a wait on the capturing stream, so the forward can be captured and replayed."""
    from moe_lora_harness.kernels.schedule.cuda import CudaSchedule
    layer = Layer(CASE, dual_stream_program)
    layer.set_schedule(CudaSchedule())
    layer(inputs[0], delay_inputs=False)                      # warm up (compiles kernels) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.forward()
    for i in (1, 2, 0):
        layer.hidden.copy_(inputs[i])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(layer.out.view(torch.int16), expected[i].view(torch.int16)), f"replay {i} differs"
