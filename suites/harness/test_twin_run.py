"""The twin run (harness.judge.expectation.twin_applies, compare.TWIN_FACTOR): an fp32 case of enough rows is run
twice, the second time on its reordered view (every long sum in another order), and each run is judged with the
other as the measure of its own accumulation error. Claimed both ways: a correct kernel passes, its twins' squared
difference covers its accumulation with room to spare, a slip the bound for every order admits fails, and a run
that is wrong only in the reordered order fails, naming the twin, with a REPRO of the case."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_lora_harness.backends.eager import BACKEND as EAGER
from moe_lora_harness.backends.eager import run_experts
from moe_lora_harness.harness.build.properties import OP_TWIN_B_SCALE
from moe_lora_harness.harness.execution.execute import InProcess
from moe_lora_harness.harness.execution.runner import ON_ITS_OWN, TWIN_RUN, _twin_side, expectations, run_case
from moe_lora_harness.harness.judge.compare import EXCESS_MIN_ROWS, TWIN_FACTOR
from moe_lora_harness.harness.judge.expectation import (MMA_PRODUCTS_MAX, TWIN_MIN_SUM, TWIN_ROW_ELEMENTS, Rules,
                                                        judge_output,
                                                        judge_twins, mma_products, row_elements, row_groups,
                                                        twin_applies, twin_own_emulation, twin_own_truth)
from moe_lora_harness.harness.selftest import power
from moe_lora_harness.harness.spec.case import Case

F64 = torch.float64
# 128 rows: enough for rule 4 (EXCESS_MIN_ROWS), small enough for the CPU in a second
CASE = Case(level="expert", T=128, H=256, I=128, E=4, top_k=2, max_loras=2, max_rank=8, mapping="mixed",
            dtype="float32", seed=3)
# a w13 fused_moe_lora call, x (256, 256), rank 8: rows enough that rule 4 fails a run held to itself (at 128 rows
# the correct op's excess over its emulation sits at 0.96 of the threshold)
OP_CASE = CASE.replace(level="op", T=256)
# TP with fully-sharded LoRA: every shard of H and I permuted within (each rank holds the same positions)
TP_CASE = CASE.replace(tp_size=2, fully_sharded=True)


def _spec(name, experts=None, op=None):
    """A test backend: the eager one with its expert function `experts`, or its op `op`, replaced (the other level
    not provided)."""
    return dataclasses.replace(EAGER, name=name, experts=experts, op=op, description=f"test backend {name}")


def _pair(case):
    """(truth, emulation, precision, rules, out, twin) of the eager backend on `case` (expert or op level) and its
    reordered view, as the runner judges them (power.correct_run), and a judge of such a pair of outputs (the twin's
    own truth and emulation where it has them: the op level's)."""
    c = power.correct_run(EAGER, case, "cpu")
    rules = Rules("cpu", c.points_only, row_groups(c.inputs, c.truth))

    def judge(out, twin):
        return judge_twins(case, out, twin, c.truth, c.emulation.value, c.precision, rules, c.twin_emulation,
                           c.twin_truth)
    return c.truth, c.emulation, c.precision, rules, c.out, c.twin, judge


def _deviations(case):
    """(out - its emulation, twin - its own emulation) of the eager backend's pair on `case`, float64: what the twin
    measures (expectation.held_to)."""
    c = power.correct_run(EAGER, case, "cpu")
    own = c.emulation.value if c.twin_emulation is None else c.twin_emulation
    return c.out.to(F64) - c.emulation.value, c.twin.to(F64) - own, c


def test_the_twin_runs_where_rule_4_can_act_on_an_fp32_output():
    assert twin_applies(CASE)
    assert not twin_applies(CASE.replace(T=EXCESS_MIN_ROWS - 1))      # rule 4 cannot fail so few rows, and rule 3's
    # twin measure needs rows of TWIN_ROW_ELEMENTS to beat the bound: one token of H 512 has it, of H 256 not
    assert row_elements(CASE) < TWIN_ROW_ELEMENTS <= row_elements(CASE.replace(H=TWIN_ROW_ELEMENTS))
    assert twin_applies(CASE.replace(T=1, H=TWIN_ROW_ELEMENTS)) and not twin_applies(CASE.replace(T=1))
    assert not twin_applies(CASE.replace(T=1, H=TWIN_ROW_ELEMENTS, dtype="float16"))
    assert not twin_applies(CASE.replace(dtype="float16"))            # its rounding, not its sums, bounds it
    assert not twin_applies(CASE.replace(view="reordered"))           # a view is judged alone
    assert not twin_applies(CASE.replace(quant="int8_channel"))       # quantized K blocks do not permute
    # every sum it reorders TWIN_MIN_SUM terms or more (short sums round alike in both orders): H, a TP shard of I, K
    assert twin_applies(CASE.replace(I=TWIN_MIN_SUM)) and not twin_applies(CASE.replace(I=TWIN_MIN_SUM - 1))
    assert not twin_applies(CASE.replace(H=TWIN_MIN_SUM - 1)) and not twin_applies(CASE.replace(tp_size=4, I=128 + 4))
    assert not twin_applies(CASE.replace(level="op", H=TWIN_MIN_SUM - 1))           # w13: K is H
    assert not twin_applies(CASE.replace(tp_size=2, H=255))          # shards that do not divide H: no view to build
    # the op level: its K permuted through x and every LoRA A (each shrink in another order), every LoRA B scaled (each
    # expand rounds elsewhere), the columns kept; its own truth and emulation (the expert level's are the case's)
    assert twin_applies(OP_CASE) and twin_applies(OP_CASE.replace(which="w2"))
    assert twin_own_truth(OP_CASE) and twin_own_emulation(OP_CASE) and not twin_own_truth(CASE)
    assert not twin_applies(OP_CASE.replace(dtype="float16")) and not twin_applies(OP_CASE.replace(view="reordered"))
    assert not twin_applies(OP_CASE.replace(T=EXCESS_MIN_ROWS - 1, I=64))     # a row: 2 routes x 2 slices x 64
    assert twin_applies(OP_CASE.replace(T=EXCESS_MIN_ROWS - 1))                # ... x 128 = TWIN_ROW_ELEMENTS
    # TP (each rank's shard permuted within) and dispatched EP (H and I are not split across its ranks)
    assert twin_applies(TP_CASE) and twin_applies(CASE.replace(tp_size=2))
    assert twin_applies(CASE.replace(ep_size=2, ep_tokens=(64, 64)))
    assert not twin_applies(TP_CASE.replace(dtype="float16"))
    # FP8 activations: for a backend declared to round at its model's points whose e4m3 products sum exactly where it
    # runs (a CPU, or a declared "fp32" accumulation), the twin measures its flips too
    fp8 = CASE.replace(quant="fp8_w8a8", dtype="float16")
    assert twin_applies(fp8, "cpu", None, True) and twin_applies(fp8, "cuda:0", "fp32", True)
    assert not twin_applies(fp8, "cpu", None, False)          # other points' flips need not differ between orders
    # under a truncating MMA the judge emulates, each run is held to its own emulation (twin_own_emulation), where
    # both emulations fit the emulation's cap
    assert twin_applies(fp8, "cuda:0", 128, True) and twin_own_emulation(fp8, 128)
    assert not twin_own_emulation(fp8, "fp32") and not twin_own_emulation(fp8) and not twin_own_emulation(CASE, 128)
    big = fp8.replace(T=2048, H=4096, I=4096)
    assert 2 * mma_products(big) > MMA_PRODUCTS_MAX >= mma_products(big) and not twin_applies(big, "cuda:0", 128, True)
    assert not twin_applies(fp8, "cuda:0", None, True) and not twin_applies(fp8)
    assert not twin_applies(fp8.replace(T=EXCESS_MIN_ROWS - 1), "cpu", None, True)
    assert not twin_applies(fp8.replace(tp_size=2), "cpu", None, True)     # one rank's flips alone are modelled


def test_the_judge_runs_the_backend_twice_only_where_the_twin_applies():
    calls = []

    def counted(call):
        calls.append(call.hidden_states.shape)
        run_experts(call)

    spec = _spec("counted", counted)
    # (case, calls): one rank; TP, each rank once; fully sharded TP, each rank in three passes (SimulatedTPGroup)
    for case, runs in ((CASE, 2), (CASE.replace(dtype="float16"), 1), (CASE.replace(tp_size=2), 4),
                       (TP_CASE, 12), (TP_CASE.replace(dtype="float16"), 6),
                       (CASE.replace(T=1, H=TWIN_ROW_ELEMENTS), 2), (CASE.replace(T=1), 1)):
        calls.clear()
        assert run_case(spec, case, "cpu", executor=InProcess(), reruns=0).status == "pass", case
        assert len(calls) == runs, case


def test_a_dispatched_ep_case_runs_its_twin_and_passes():
    """Dispatched EP: each rank's experts see the same tokens in both runs, H and I permuted (our Triton experts, the
    backend that declares it; compiled on a GPU host, in the interpreter elsewhere: in this process a compiled kernel
    cannot read CPU tensors)."""
    from moe_lora_harness.backends.experts import TRITON_EXPERTS
    from moe_lora_harness.harness.execution.device import interpreting
    device = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
    if not TRITON_EXPERTS.capabilities.devices:
        pytest.skip(f"triton_experts unavailable here: {TRITON_EXPERTS.capabilities.rules[0].reason}")
    calls = []

    def counted(call):
        calls.append(call.hidden_states.shape)
        TRITON_EXPERTS.experts(call)

    spec = dataclasses.replace(TRITON_EXPERTS, name="counted-ep", experts=counted)
    case = CASE.replace(ep_size=2, ep_tokens=(60, 68))
    out = run_case(spec, case, device, executor=InProcess(), reruns=0)
    assert out.status == "pass", out.message
    assert len(calls) == 4


def test_the_judge_runs_an_op_twice_only_where_the_twin_applies():
    seen = []

    def counted(**kw):
        seen.append(kw["qcurr_hidden_states"].clone())
        EAGER.op(**kw)

    spec = _spec("counted-op", op=counted)
    for case, runs in ((OP_CASE, 2), (OP_CASE.replace(which="w2"), 2), (OP_CASE.replace(dtype="float16"), 1),
                       (OP_CASE.replace(add_inputs=False), 2), (OP_CASE.replace(T=1), 2)):
        seen.clear()
        assert run_case(spec, case, "cpu", executor=InProcess(), reruns=0).status == "pass", case
        assert len(seen) == runs, case
    # the twin's x is the plain x with its columns (K) permuted: the same values, another order
    assert not torch.equal(seen[0], seen[1]) and torch.equal(seen[0].sort(dim=1).values, seen[1].sort(dim=1).values)


@pytest.mark.parametrize("case", [CASE, TP_CASE], ids=["one-rank", "tp"])
def test_the_twins_difference_covers_the_kernels_accumulation_with_room(case):
    """q = |a - b|^2 / (2 X), X the kernel's squared error beyond the emulation's: TWIN_FACTOR 2 q >= 1 is what the
    allowance needs; independent roundings give q near 1 (the room is for correlated partial sums)."""
    c = power.correct_run(EAGER, case, "cpu")
    tv, out, twin = c.truth.value, c.out.to(F64), c.twin.to(F64)
    excess = float(((out - tv) ** 2).sum() - ((c.emulation.value - tv) ** 2).sum())
    q = float(((out - twin) ** 2).sum()) / (2 * excess)
    assert TWIN_FACTOR * 2 * q >= 2.0, q
    assert not torch.equal(c.out, c.twin), "the twin must sum in another order"


def test_the_op_twins_difference_covers_its_accumulation_with_room():
    """The op level's twin (K permuted: each shrink in another order) measures the op's accumulation as the expert
    level's does: q near 1, TWIN_FACTOR 2 q >= 1 needed."""
    for which in ("w13", "w2"):
        a, b, c = _deviations(OP_CASE.replace(which=which))
        tv = c.truth.value
        excess = float(((c.out.to(F64) - tv) ** 2).sum() - ((c.emulation.value - tv) ** 2).sum())
        q = float(((a - b) ** 2).sum()) / (2 * excess)
        assert TWIN_FACTOR * 2 * q >= 2.0, (which, q)
        assert not torch.equal(a, b), "the twin must sum in another order"


@pytest.mark.parametrize("case", [CASE, OP_CASE, TP_CASE], ids=["expert", "op", "tp"])
def test_a_spread_slip_fails_with_the_twin_at_a_smaller_size_than_without(case):
    """A slip spread like the accumulation's allowance (in both runs: it does not depend on the order) fails rule 4 with
    the twin at under 2.5 times the kernel's own error (the model: sqrt(2 q TWIN_FACTOR - 1) = 1.4, plus the tail), and
    strictly sooner than under the bound for every order, whose threshold follows the kernel's share of acc_var (3-4
    with this CPU's GEMM); the correct pair passes."""
    truth, emu, precision, rules, out0, twin0, judge = _pair(case)
    tv, out, twin = truth.value, out0.to(F64), twin0.to(F64)
    g = torch.randn(tv.shape, generator=torch.Generator().manual_seed(1), dtype=F64) * truth.acc_var.sqrt()
    g = g * (float((out - tv).norm()) / float(g.norm()))          # a slip of the kernel's own size
    # the op's twin scales every LoRA B, so a slip of the delta is scaled alike there
    twin_g = g * (OP_TWIN_B_SCALE if case.level == "op" else 1.0)

    def fails(m: float, paired: bool) -> bool:
        if paired:
            return not judge((out + m * g).float(), (twin + m * twin_g).float()).ok
        return not judge_output(case, (out + m * g).float(), truth, emu.value, precision, rules).ok

    def threshold(paired: bool) -> float:
        assert not fails(0.25, paired) and fails(64.0, paired)
        return power.bisect_geometric(lambda m: fails(m, paired), 0.25, 64.0, steps=12)

    assert judge(out0, twin0).ok
    with_twin, alone = threshold(True), threshold(False)
    assert with_twin <= 2.5 and with_twin < alone, (with_twin, alone)
    v = judge((out + with_twin * g).float(), (twin + with_twin * twin_g).float())
    assert "rule 4" in v.message and "as its twin run measured it" in v.message, v.message


@pytest.mark.parametrize("case", [CASE, CASE.replace(tp_size=2)], ids=["one-rank", "tp"])
def test_a_run_wrong_only_in_the_reordered_order_fails_naming_the_twin(case):
    """A stale cache keyed by the routing (and the TP rank; a real class of bug): the twin, routed alike, gets the
    plain run's columns back. The plain run passes; the case fails, as the twin's, with a REPRO of the case."""
    cache: dict = {}

    def stale(call):
        key = (call.topk_ids.cpu().numpy().tobytes(), call.tp_rank)
        if key in cache:
            call.output.copy_(cache[key])
            return
        run_experts(call)
        cache[key] = call.output.clone()

    out = run_case(_spec("stale-cache", stale), case, "cpu", executor=InProcess(), reruns=0)
    assert out.status == "fail" and out.kind in ("element", "aggregate"), out.detail
    assert TWIN_RUN in out.message and "REPRO:" in out.detail and '"view"' not in out.detail.split("REPRO:")[1]


def test_an_op_that_returns_one_output_for_both_orders_fails_on_its_twin():
    """The stale cache at the op level: the twin, routed alike, gets the plain call's output back. The columns stay
    (the op's view moves none), but the twin's LoRA B is scaled (OP_TWIN_B_SCALE), so its truth is another: the
    plain run passes, and the twin, judged against its own truth, fails, naming the twin, with a REPRO of the case."""
    cache: dict = {}

    def stale(**kw):
        key = kw["topk_weights"].cpu().numpy().tobytes()
        if key in cache:
            kw["output"].copy_(cache[key])
            return
        EAGER.op(**kw)
        cache[key] = kw["output"].clone()

    out = run_case(_spec("stale-cache-op", op=stale), OP_CASE, "cpu", executor=InProcess(), reruns=0)
    assert out.status == "fail" and out.kind in ("element", "aggregate"), out.detail
    assert TWIN_RUN + ON_ITS_OWN in out.message, out.message
    # its diagnoses re-judge it as its verdict did: against the twin's truth, on the twin's inputs
    exp = expectations(EAGER, OP_CASE, "cpu")
    side = _twin_side(exp)
    assert side.truth is exp.twin_truth and not torch.equal(side.truth.value, exp.truth.value)
    assert torch.equal(side.inputs.lora_b[0], (exp.inputs.lora_b[0] * OP_TWIN_B_SCALE).float())
    assert "REPRO:" in out.detail and '"view"' not in out.detail.split("REPRO:")[1]
    cache.clear()
    assert run_case(_spec("stale-cache-op", op=stale), OP_CASE.replace(dtype="float16"), "cpu",
                    executor=InProcess(), reruns=0).status == "pass"    # no twin: one call, nothing stale


def test_a_twin_that_raises_is_the_cases_failure():
    seen = []

    def second_raises(call):
        seen.append(1)
        if len(seen) > 1:
            raise RuntimeError("out of shared memory")
        run_experts(call)

    out = run_case(_spec("second-raises", second_raises), CASE, "cpu", executor=InProcess(), reruns=0)
    assert out.status == "fail" and out.kind == "raised" and TWIN_RUN in out.message, out.detail


def test_an_error_both_runs_make_alike_passes_at_a_few_ulps_and_fails_when_gross(monkeypatch):
    """The twin cannot see an error its two runs make alike (an approximate fp32 activation: the same values, the same
    error, in either order); the allowance's room does. An undeclared kernel whose SiLU is 8 ulps off at every value
    (a GPU's fast exp errs by about 2 + 1.2|x| ulps) passes; 64 ulps fails. Measured (docs/error-model.md, "The twin
    run"): 16 ulps fails this case, with the twin and, on one seed of two, without it."""
    from moe_lora_harness.kernels import eager_experts
    real = eager_experts._ACT_AND_MUL["silu"]
    spec = dataclasses.replace(_spec("approximate-silu", run_experts), model_points_only=False)

    def off_by(ulps):
        def silu(v):
            y = real(v)
            sign = ((y.view(torch.int32) >> 3) & 1).to(y.dtype) * 2 - 1       # fixed by the value: alike in both runs
            return y * (1 + sign * ulps * 2.0 ** -23)
        return silu

    for ulps, status in ((8, "pass"), (64, "fail")):
        monkeypatch.setitem(eager_experts._ACT_AND_MUL, "silu", off_by(ulps))
        out = run_case(spec, CASE, "cpu", executor=InProcess(), reruns=0)
        assert out.status == status, (ulps, out.message)
