"""The dual-stream executor: every schedule it can emit is race-free (Recorder, across consecutive calls),
its structure is what spec 5 describes, its numerics are rnd(cache + rnd(delta)), and the Triton experts
create their aux stream and events once per layer."""
from __future__ import annotations

import itertools

import pytest
import torch

from moe_lora_harness.harness.build.builders import build_expert_inputs, torch_dtype
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.judge.compare import compare_written
from moe_lora_harness.harness.build.expert_runner import expert_expectations
from moe_lora_harness.kernels.experts.dual_stream import AUX, EVENTS, PLANS, dual_stream_program
from moe_lora_harness.kernels.schedule import MAIN, Recorder

from .stand_in import TorchPhases, all_programs, allocate_workspace, run_dual_stream

CASE = Case(level="expert", T=7, H=32, I=16, E=4, top_k=2, max_loras=3, max_rank=4, mapping="mixed",
            dtype="float16", activation="silu", seed=7)


def stand_in(case: Case):
    """(inputs, torch stand-in phases, fresh poisoned buffers) for an expert-level case."""
    inp = build_expert_inputs(case)
    s = inp.stacked
    phases = TorchPhases(inp.w13, inp.w2, inp.topk_weights, inp.topk_ids, lora=(s.w13_a, s.w13_b, s.w2_a[0], s.w2_b[0]),
                         token_lora_mapping=inp.token_lora_mapping, adapter_enabled=s.adapter_enabled)

    def buffers():
        b = allocate_workspace(case.T, case.top_k, 2 * case.I, case.I, case.H, torch_dtype(case), "cpu")
        b.update(hidden=inp.hidden, topk_ids=inp.topk_ids, topk_weights=inp.topk_weights,
                 out=torch.full((case.T, case.H), float("nan"), dtype=torch_dtype(case)))
        return b
    return inp, phases, buffers


def verdict(case: Case, out: torch.Tensor, preset: str = "dual_stream"):
    _, truth, emu = expert_expectations(case, preset)
    return compare_written(out, truth.value, emu.value, truth.scale, torch.ones(case.T, case.H, dtype=torch.bool),
                           dtype=torch_dtype(case), k_plus_r=case.H + case.I + case.max_rank, names=("t", "h"))


# ------------------------------------------------------------------------------ the programs


@pytest.mark.parametrize("first,second", list(itertools.product(PLANS, PLANS)))
def test_every_schedule_is_race_free_across_consecutive_calls(first, second):
    _, phases, buffers = stand_in(CASE)
    r, b = Recorder(execute=False), buffers()
    for plan in (first, second, first):
        run_dual_stream(r, phases, b, plan)
    assert r.clean, "\n".join(r.problems) + "\n" + r.trace()


def test_program_structure_matches_spec_5():
    prog = dual_stream_program("both")
    launches = {s.name: s.stream for s in prog if s.kind == "launch"}
    assert {n for n, st in launches.items() if st == AUX} == {"zero_delta1", "lora_w13", "zero_delta2", "lora_w2"}
    assert launches["base_w13"] == launches["base_w2"] == launches["add_w13"] == launches["add_w2"] == MAIN
    records = [(s.name, s.stream) for s in prog if s.kind == "record"]
    waits = [(s.name, s.stream) for s in prog if s.kind == "wait"]
    assert sorted(n for n, _ in records) == sorted(EVENTS) == sorted(n for n, _ in waits)   # four, none reused
    for name, rec_stream in records:
        assert dict(waits)[name] != rec_stream                       # every event crosses streams
    aux = [s for s in prog if s.stream == AUX]
    assert aux[0].kind == "wait" and aux[4].kind == "wait"           # each aux chain starts by waiting (capturable)
    names = [s.name for s in prog]
    assert names.index("zero_delta1") < names.index("lora_w13") and names.index("zero_delta2") < names.index("lora_w2")
    assert names.index("lora_w13") < names.index("base_w13")         # the aux work is issued first: it overlaps
    assert set(all_programs()) == set(PLANS)
    assert not any(s.stream == AUX for s in all_programs()["no_lora"])


def test_torch_phases_dual_stream_matches_the_reference_model():
    _, phases, buffers = stand_in(CASE)
    r = Recorder()
    out = run_dual_stream(r, phases, buffers())
    assert r.clean, r.problems
    v = verdict(CASE, out)
    assert v.ok, v.message


def test_bad_arguments_are_named():
    _, phases, buffers = stand_in(CASE)
    b = buffers()
    with pytest.raises(TypeError, match="sched must be a kernels.schedule.Schedule"):
        run_dual_stream(object(), phases, b)
    with pytest.raises(ValueError, match="plan must be a Plan or one of"):
        run_dual_stream(Recorder(), phases, b, plan="sometimes")
    del b["delta2"]
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['delta2'\]"):
        run_dual_stream(Recorder(), phases, b)
    with pytest.raises(ValueError, match="I must be an int >= 1"):
        allocate_workspace(2, 2, 8, 0, 8, torch.float16, "cpu")


# ------------------------------------------------------------------------------ the Triton experts

try:
    from moe_lora_harness.backends.dual_stream import BACKEND, dual_stream_precision
    from moe_lora_harness.backends.experts import config_from_call, context_from_call
    from moe_lora_harness.kernels.experts.dual_stream_experts import DualStreamTritonExperts
    from moe_lora_harness.kernels.experts.lora_context import MoELoRAContext
    from moe_lora_harness.kernels.experts.modular import FusedMoEKernel
    from moe_lora_harness.kernels.experts.prepare_finalize import NoEPPrepareAndFinalize
    from moe_lora_harness.kernels.experts.triton_experts import TritonExperts
    from moe_lora_harness.kernels.triton.platform import interpreting
    _MISSING = "" if interpreting() else "CPU Triton runs need the interpreter (TRITON_INTERPRET=1; the CPU lane)"
except Exception as e:  # noqa: BLE001
    _MISSING = f"Triton experts not importable: {type(e).__name__}: {e}"

needs_experts = pytest.mark.skipif(bool(_MISSING), reason=_MISSING or "available")


def run_layer(experts, call, *, dual=True, mutate_ctx=None):
    config = config_from_call(call)
    ctx = context_from_call(call, config)
    ctx.dual_stream = dual
    if mutate_ctx:
        mutate_ctx(ctx)
    out = torch.full_like(call.output, float("nan"))
    FusedMoEKernel(NoEPPrepareAndFinalize(), experts).apply(
        call.hidden_states, call.w13, call.w2, call.topk_weights, call.topk_ids, lora_ctx=ctx,
        expert_map=call.expert_map, w13_bias=call.w13_bias, w2_bias=call.w2_bias, output=out)
    return out


def same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@needs_experts
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_dual_stream_equals_sequential_bit_for_bit_on_the_one_shot_path(activation):
    # one-shot sequential: rnd(cache + rnd(delta)); dual stream: the same formula, in two steps
    case = Case(**{**CASE.__dict__, "activation": activation, "T": 9})
    call = build_expert_inputs(case).call("cpu")
    config = config_from_call(call)
    assert TritonExperts.lora_path(config, case.T, case.max_loras) == "one_shot"
    experts = DualStreamTritonExperts(config)
    dual = run_layer(experts, call)
    seq = run_layer(TritonExperts(config), call, dual=False)
    assert experts.last_plan == "both" and experts.dual_stream_schedule.clean
    assert same_bits(dual, seq)


@needs_experts
def test_aux_stream_and_events_are_created_once_per_layer():
    call = build_expert_inputs(CASE).call("cpu")
    config = config_from_call(call)
    layer, other = DualStreamTritonExperts(config), DualStreamTritonExperts(config)
    outs = [run_layer(layer, call) for _ in range(3)]
    sched = layer.dual_stream_schedule
    assert (sched.created_streams, sched.created_events) == (1, 4)
    assert sched.stream_names == (MAIN, AUX) and set(sched.event_names) == set(EVENTS)
    assert sum(op.kind == "record" for op in sched.ops) == 3 * 4          # re-recorded every call, never recreated
    assert sched.clean, sched.problems                                     # three calls, one recorder: no race
    assert all(same_bits(o, outs[0]) for o in outs)
    run_layer(other, call)
    assert other.dual_stream_schedule is not sched                         # per layer, not global
    assert layer.dual_stream_schedule is sched


@needs_experts
def test_single_stream_when_flag_off_or_fully_sharded():
    call = build_expert_inputs(CASE).call("cpu")
    config = config_from_call(call)
    experts = DualStreamTritonExperts(config)
    run_layer(experts, call, dual=False)
    assert experts.dual_stream_schedule is None
    ctx = context_from_call(call, config)
    ctx.dual_stream, ctx.fully_sharded = True, True
    assert not DualStreamTritonExperts.uses_dual_stream(ctx)


@needs_experts
def test_batches_above_the_token_cap_run_on_one_stream():
    """dual_stream_max_tokens gates the mode by batch size: above it the layer is plain TritonExperts (no
    schedule, no aux launch, the same bits as single stream); None runs every batch on two streams."""
    case = Case(**{**CASE.__dict__, "T": 9})
    call = build_expert_inputs(case).call("cpu")
    config = config_from_call(call)
    seq = run_layer(TritonExperts(config), call, dual=False)
    gated = DualStreamTritonExperts(config)
    out = run_layer(gated, call, mutate_ctx=lambda c: setattr(c, "dual_stream_max_tokens", 8))
    assert gated.dual_stream_schedule is None and gated.last_plan is None
    assert same_bits(out, seq)
    for cap in (9, None):
        dual = DualStreamTritonExperts(config)
        out = run_layer(dual, call, mutate_ctx=lambda c, cap=cap: setattr(c, "dual_stream_max_tokens", cap))
        assert dual.last_plan == "both" and any(op.stream == AUX for op in dual.dual_stream_schedule.ops), cap
        assert same_bits(out, seq)
    ctx = context_from_call(call, config)
    assert ctx.dual_stream_max_tokens == 128                               # the measured H200 crossover
    ctx.dual_stream = True
    assert DualStreamTritonExperts.uses_dual_stream(ctx, 128) and not DualStreamTritonExperts.uses_dual_stream(ctx, 129)
    with pytest.raises(ValueError, match="dual_stream_max_tokens"):
        MoELoRAContext(**{**ctx.__dict__, "dual_stream_max_tokens": -1})


@needs_experts
def test_no_lora_batch_takes_the_base_only_schedule():
    case = Case(**{**CASE.__dict__, "mapping": "none"})
    call = build_expert_inputs(case).call("cpu")
    experts = DualStreamTritonExperts(config_from_call(call))
    dual = run_layer(experts, call)
    assert experts.last_plan == "no_lora"
    assert not any(op.stream == AUX for op in experts.dual_stream_schedule.ops)
    assert same_bits(dual, run_layer(TritonExperts(config_from_call(call)), call, dual=False))


@needs_experts
def test_backend_precision_follows_the_lora_path():
    small = Case(**{**CASE.__dict__, "T": 1, "E": 8, "max_loras": 4})      # naive, T*k*R small: small-batch
    assert dual_stream_precision(small) == "dual_stream_small_batch"
    assert dual_stream_precision(CASE) == "dual_stream"
    assert dual_stream_precision(Case(**{**CASE.__dict__, "lora": False})) == "one_shot"
    assert dual_stream_precision(Case(**{**CASE.__dict__, "T": 129})) == "one_shot"   # above the cap: one stream


@needs_experts
@pytest.mark.parametrize("case", [
    CASE,
    Case(**{**CASE.__dict__, "T": 1, "E": 8, "max_loras": 4, "seed": 3}),       # small-batch deltas
    Case(**{**CASE.__dict__, "activation": "relu2_no_mul", "bias": True, "ep_size": 2, "ep_rank": 1, "E": 8}),
], ids=["silu-mixed", "small-batch", "relu2-bias-ep"])
def test_backend_passes_the_error_model(case):
    from moe_lora_harness.harness.execution.runner import run_case
    outcome = run_case(BACKEND, case, "cpu")
    assert outcome.status == "pass", outcome.detail or outcome.reason
