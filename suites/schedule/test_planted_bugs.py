"""Planted schedule bugs are caught on the CPU: a race (or event hazard) from the Recorder for each racy one,
a wrong answer under the error model for the delta buffer that is not zeroed, both with torch stand-in
phases and with the real Triton experts. The correct program passes the same checks."""
from __future__ import annotations

import pytest
import torch

from moe_lora_harness.harness.build.builders import build_expert_inputs, torch_dtype
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.judge.compare import compare_written
from moe_lora_harness.harness.build.expert_runner import expert_expectations
from moe_lora_harness.kernels.experts.dual_stream import dual_stream_program, run_program
from moe_lora_harness.kernels.schedule import Recorder, ScheduleError

from .planted_schedules import PLANTED, RACY, planted_program
from .stand_in import POISON, TorchPhases, allocate_workspace

# mixed mapping: some tokens carry no adapter, so their pairs are never written by the LoRA kernels
CASE = Case(level="expert", T=7, H=32, I=16, E=4, top_k=2, max_loras=3, max_rank=4, mapping="mixed",
            dtype="float16", activation="silu", seed=11)

# the buffer each racy bug's race must name
RACE_ON = {"missing_wait": "delta1", "record_before_kernel": "delta2", "event_reused": "cache2",
           "delta_read_early": "delta2", "aux_no_input_wait": "hidden"}


def test_every_planted_bug_is_classified():
    assert set(RACE_ON) == set(RACY) and set(PLANTED) == set(RACY) | {"not_zeroed"}
    for bug in PLANTED:
        assert planted_program(bug) != dual_stream_program("both")


def run_stand_in(program, calls: int = 2):
    """Run `program` `calls` times (same workspace, as a layer would) with stand-in phases; (recorder, out)."""
    inp = build_expert_inputs(CASE)
    s = inp.stacked
    phases = TorchPhases(inp.w13, inp.w2, inp.topk_weights, inp.topk_ids, lora=(s.w13_a, s.w13_b, s.w2_a[0], s.w2_b[0]),
                         token_lora_mapping=inp.token_lora_mapping, adapter_enabled=s.adapter_enabled)
    dt = torch_dtype(CASE)
    b = allocate_workspace(CASE.T, CASE.top_k, 2 * CASE.I, CASE.I, CASE.H, dt, "cpu")
    b.update(hidden=inp.hidden, topk_ids=inp.topk_ids, topk_weights=inp.topk_weights,
             out=torch.full((CASE.T, CASE.H), float("nan"), dtype=dt))
    r = Recorder()
    for _ in range(calls):
        run_program(r, program, phases, b)
    return r, b["out"]


def judge(out):
    _, truth, emu = expert_expectations(CASE, "dual_stream")
    return compare_written(out, truth.value, emu.value, truth.scale, torch.ones(CASE.T, CASE.H, dtype=torch.bool),
                           dtype=torch_dtype(CASE), k_plus_r=CASE.H + CASE.I + CASE.max_rank, names=("t", "h"))


def test_the_correct_program_passes_both_checks():
    r, out = run_stand_in(dual_stream_program("both"))
    assert r.clean, r.problems
    assert judge(out).ok


@pytest.mark.parametrize("bug", RACY)
def test_racy_bug_is_a_race_on_the_right_buffer(bug):
    r, _ = run_stand_in(planted_program(bug))
    assert r.races, f"{bug}: no race found\n{r.trace()}"
    assert RACE_ON[bug] in {x.buffer for x in r.races}, r.problems
    if bug == "event_reused":
        assert any(h.kind == "event-reuse" and h.event == "x_ready" for h in r.hazards), r.problems
    with pytest.raises(ScheduleError):
        r.assert_clean()


def test_not_zeroed_is_race_free_but_the_comparison_catches_it():
    assert POISON != 0
    r, out = run_stand_in(planted_program("not_zeroed"), calls=1)
    assert r.clean, r.problems                  # no race: only the values can tell
    v = judge(out)
    assert not v.ok and v.kind in ("element", "aggregate"), v.message


# ------------------------------------------------------------------------------ on the Triton experts

try:
    from moe_lora_harness.backends.dual_stream import dual_stream_precision
    from moe_lora_harness.backends.experts import config_from_call, context_from_call
    from moe_lora_harness.harness.spec.contract import BackendSpec, Capabilities
    from moe_lora_harness.harness.execution.runner import run_case
    from moe_lora_harness.suites.schedule.planted_backends import planted_backend
    from moe_lora_harness.kernels.experts.dual_stream_experts import DualStreamTritonExperts
    from moe_lora_harness.kernels.experts.modular import FusedMoEKernel
    from moe_lora_harness.kernels.experts.prepare_finalize import NoEPPrepareAndFinalize
    from moe_lora_harness.kernels.triton.platform import interpreting
    _MISSING = "" if interpreting() else "CPU Triton runs need the interpreter (TRITON_INTERPRET=1; the CPU lane)"
except Exception as e:  # noqa: BLE001
    _MISSING = f"Triton experts not importable: {type(e).__name__}: {e}"


@pytest.mark.skipif(bool(_MISSING), reason=_MISSING or "available")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # a racy read of uninitialised memory
@pytest.mark.parametrize("bug", [None, *PLANTED])
def test_planted_bug_in_the_triton_experts_fails_the_case(bug):
    outcome = run_case(planted_backend(bug), CASE, "cpu")
    if bug is None:
        assert outcome.status == "pass", outcome.detail
        return
    assert outcome.status == "fail", f"{bug} was not caught: {outcome.status} {outcome.reason}"
    if bug in RACY:
        assert outcome.kind == "raised" and "ScheduleError:" in outcome.detail, outcome.detail
        assert f"race on {RACE_ON[bug]}" in outcome.detail, outcome.detail
    else:
        assert outcome.verdict is not None and outcome.verdict.kind in ("element", "aggregate"), outcome.detail
