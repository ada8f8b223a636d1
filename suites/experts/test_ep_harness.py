"""The harness's dispatched expert-parallel runner (harness/execution/ep_ranks.py) under both drivers: simulated ranks
(threads taking turns) and real processes (gloo on the CPU, NCCL with a GPU per rank).

Every planted EP bug (suites/experts/ep_mutants.py) must fail under each driver and the control must pass;
ranks that skip a collective, raise or die give a verdict naming the rank within the collective timeout,
never a hang; hypothesis draws dispatched cases (uneven counts, empty ranks, mapping patterns) for a
backend that declares EP. Truth: the float64 reference of the whole concatenated batch (reference.sharding's
EP forward), each rank's rows compared within the error model (docs/error-model.md, "EP combine").
"""
from __future__ import annotations

import os
import time

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from moe_lora_harness.harness.build.builders import build_expert_inputs
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.contract import must_reject, support_for
from moe_lora_harness.harness.execution.ep_ranks import TIMEOUT_ENV, driver_problem, rank_call
from moe_lora_harness.harness.execution.execute import InProcess
from moe_lora_harness.harness.draw.profiles import draw_sizes
from moe_lora_harness.harness.spec.registry import load_ref
from moe_lora_harness.harness.execution.runner import run_case
from moe_lora_harness.harness.draw.strategies import (
    MAX_EXAMPLES_ENV, claimed_cases, profile, suite_settings)
from moe_lora_harness.harness.execution.worker import Supervisor
from moe_lora_harness.suites.experts.ep_mutants import CASES, MUTANTS

REF = "moe_lora_harness.suites.experts.ep_mutants"
DRIVERS = ("simulated", "processes")


@pytest.fixture(scope="module")
def ep_backends():
    return {s.name: s for s in load_ref(f"{REF}:MUTANTS") + load_ref(f"{REF}:HOSTILE")}


def _dtype_for(device):
    return "bfloat16" if str(device).startswith("cuda") else "float32"


def _run(spec, case, device, **kw):
    outcome = run_case(spec, case, device, executor=kw.pop("executor", None) or InProcess(), reruns=0, **kw)
    if not outcome.judged:     # declined, or not runnable on this machine (NCCL ranks need a GPU each)
        pytest.skip(f"{spec.name}: {outcome.reason}")
    return outcome


# the process driver's rows in the full tier (the gate: every planted bug under the simulated ranks, and the
# process driver by its own tests below)
@pytest.mark.parametrize("driver", [pytest.param(d, marks=(pytest.mark.slow,) if d == "processes" else ()) for d in DRIVERS])
@pytest.mark.parametrize("name", [m.name for m in MUTANTS])
def test_planted_ep_bug_fails_under_each_driver(name, driver, ep_backends, device):
    case = CASES[name].replace(ep_comm=driver, dtype=_dtype_for(device))
    outcome = _run(ep_backends[name], case, device)
    if name == "ep-control":
        assert outcome.status == "pass", outcome.detail
        return
    assert outcome.status == "fail", f"{name} under {driver} was not caught: {outcome.status} {outcome.reason}"
    assert "CASE: " in outcome.detail and "REPRO: " in outcome.detail
    if must_reject(case) is not None:
        assert outcome.kind == "accepted"
    else:
        assert "ep_rank=" in outcome.detail     # the worst elements name the rank that holds them


@pytest.mark.parametrize("driver", DRIVERS)
def test_rank_that_skips_a_collective_fails_within_the_timeout(driver, ep_backends, device, monkeypatch):
    monkeypatch.setenv(TIMEOUT_ENV, "3")
    t0 = time.monotonic()
    outcome = _run(ep_backends["ep-rank-skips-collective"], CASES["ep-control"].replace(
        ep_comm=driver, dtype=_dtype_for(device)), device)
    assert outcome.status == "fail" and outcome.kind == "raised", outcome.detail
    assert "EP rank 0" in outcome.detail, outcome.detail
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("driver", DRIVERS)
def test_the_failing_rank_is_the_verdict(driver, ep_backends, device, monkeypatch):
    monkeypatch.setenv(TIMEOUT_ENV, "5")
    outcome = _run(ep_backends["ep-rank-raises"], CASES["ep-control"].replace(
        ep_comm=driver, dtype=_dtype_for(device)), device)
    assert outcome.status == "fail" and outcome.kind == "raised", outcome.detail
    assert "ValueError: planted failure on rank 1" in outcome.detail and "EP rank 1 of 2" in outcome.detail


def test_a_dying_rank_process_is_a_crash_naming_it(ep_backends, device):
    outcome = _run(ep_backends["ep-rank-dies"], CASES["ep-control"].replace(
        ep_comm="processes", dtype=_dtype_for(device)), device)
    assert outcome.status == "fail" and outcome.kind == "crash", outcome.detail
    assert "EP rank 1's process exited with code 7" in outcome.detail


def test_a_dying_simulated_rank_is_a_crash_of_the_worker(ep_backends, device):
    with Supervisor(timeout=120) as sup:
        outcome = _run(ep_backends["ep-rank-dies"], CASES["ep-control"].replace(dtype=_dtype_for(device)), device,
                       executor=sup)
    assert outcome.status == "fail" and outcome.kind == "crash", outcome.detail


def test_rank_call_holds_the_ranks_share(device):
    case = CASES["ep-control"].replace(ep_size=4, ep_tokens=(2, 0, 4, 1), E=8)
    built = build_expert_inputs(case)
    call = rank_call(built, case, 2, "cpu", comm=None)
    assert torch.equal(call.hidden_states, built.hidden[2:6]) and torch.equal(call.topk_ids, built.topk_ids[2:6])
    assert torch.equal(call.token_lora_mapping, built.token_lora_mapping[2:6])
    assert torch.equal(call.w13, built.w13[4:6]) and torch.equal(call.w2, built.w2[4:6])   # 2 local experts
    assert call.w13_lora_a[0].shape[1] == 8           # the adapter holds every global expert
    assert call.output.shape == (4, case.H) and call.output.isnan().all()
    assert (call.ep_rank, call.ep_size, call.num_experts_global, call.expert_map) == (2, 4, 8, None)
    empty = rank_call(built, case, 1, "cpu", comm=None)
    assert empty.hidden_states.shape == (0, case.H) and empty.output.shape == (0, case.H)


def test_by_rank_mapping_gives_each_adapter_to_one_rank():
    case = Case(level="expert", T=9, E=4, max_loras=3, mapping="by_rank", ep_size=2, ep_tokens=(4, 5))
    m = build_expert_inputs(case).token_lora_mapping
    assert set(m[:4].tolist()) == {0, -1} and set(m[4:].tolist()) == {1, -1}


def test_malformed_ep_cases_name_the_field():
    base = CASES["ep-control"]
    assert any("one token count per EP rank" in p for p in base.replace(ep_tokens=(7,)).problems())
    assert any("summing to T=7" in p for p in base.replace(ep_tokens=(3, 3)).problems())
    assert any("ep_rank is not used" in p for p in base.replace(ep_rank=1).problems())
    assert any("ep_comm must be one of" in p for p in base.replace(ep_comm="mpi").problems())
    assert any("ep_comm is used only with ep_tokens" in p
               for p in base.replace(ep_tokens=(), ep_comm="processes").problems())
    assert not base.replace(fully_sharded=True).problems()      # a configuration to refuse, not a bad case
    assert must_reject(base.replace(E=5)) is not None and must_reject(base) is None


def test_processes_on_too_few_gpus_is_a_declared_skip():
    case = CASES["ep-control"].replace(ep_comm="processes", ep_size=4, ep_tokens=(1, 2, 2, 2), E=8)
    have = torch.cuda.device_count()
    problem = driver_problem(case, "cuda")
    if have >= 4:
        assert problem == ""
    else:
        assert f"4 ranks, {have} GPU(s) here" in problem
    assert driver_problem(case.replace(ep_comm="simulated"), "cuda") == ""


def test_backend_without_ep_declaration_is_not_offered_dispatched_cases(ep_backends):
    from moe_lora_harness.backends import BUILTINS
    eager = next(s for s in BUILTINS if s.name == "eager")
    ok, reason = support_for(eager, CASES["ep-control"], "cpu")
    assert not ok and "expert_parallel" in reason


@pytest.mark.parametrize("backend_name", ["triton_experts"])
def test_ep_random(backend_name, device):
    """Hypothesis-drawn dispatched cases (simulated ranks) the backend claims, against the reference."""
    from moe_lora_harness.backends import BUILTINS
    spec = next(s for s in BUILTINS if s.name == backend_name)
    drawn = []

    # each example runs every rank through the interpreter on the CPU: 8 unless the knob asks for more
    n = profile().max_examples if os.environ.get(MAX_EXAMPLES_ENV) else min(profile().max_examples, 8)

    @suite_settings(max_examples=n)
    @given(data=st.data())
    def search(data):
        case = data.draw(claimed_cases(spec, device, "ep", **draw_sizes(device, "ep")))
        drawn.append(case)
        note(f"CASE: {case.to_json()}")
        outcome = run_case(spec, case, device, executor=InProcess())
        if outcome.failed:
            pytest.fail(outcome.detail, pytrace=False)

    search()
    assert drawn and any(0 in c.ep_tokens for c in drawn) or len(drawn) < 5


@pytest.mark.parametrize("ep", [dict(ep_tokens=(0, 2)), dict(ep_rank=1)], ids=["dispatched", "expert_map"])
def test_oai_router_weight_on_input_under_ep(ep, device):
    """Found by the wider draws: the OAI experts' second grouped GEMM bounded the pair ids by the local pair
    count (x already permuted, no routed weight read), which under EP is below T*k."""
    from moe_lora_harness.backends import BUILTINS
    spec = next(s for s in BUILTINS if s.name == "oai_experts")
    case = Case(level="expert", T=2, H=16, I=16, E=2, top_k=1, activation="swigluoai", lora=False, max_loras=1,
                max_rank=1, apply_router_weight_on_input=True, ep_size=2, **ep)
    outcome = run_case(spec, case, device, executor=InProcess(), reruns=0)
    assert outcome.status == "pass", outcome.detail
