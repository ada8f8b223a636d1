"""The property views (harness.build.properties): what each view does to the inputs, and the judge's claim both ways: a
backend that declares batch invariance and is not fails with kind not-invariant; one that is passes; an undeclared
backend whose rows happen to match gets a note, never a failure."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_lora_harness.backends.eager import BACKEND as EAGER
from moe_lora_harness.backends.eager import run_experts
from moe_lora_harness.harness.build.builders import build_expert_inputs
from moe_lora_harness.harness.spec.case import VIEWS, Case
from moe_lora_harness.reference.activations import ACTIVATIONS, UNSUPPORTED_ACTIVATIONS
from moe_lora_harness.harness.judge.compare import bit_equal
from moe_lora_harness.harness.execution.execute import InProcess
from moe_lora_harness.harness.build.expert_runner import expert_expectations
from moe_lora_harness.harness.build.properties import (TOKEN_VIEWS, contraction_order, half_tokens, plain_columns,
                                                       plain_rows)
from moe_lora_harness.harness.execution.runner import run_case

CASE = Case(level="expert", T=7, H=32, I=24, E=4, top_k=2, max_loras=3, max_rank=4, mapping="mixed", seed=5,
            dtype="float32")
VIEWED = [v for v in VIEWS if v]


def per_token(call):
    """The eager experts one token at a time: each token's row depends on its own inputs only."""
    for t in range(call.output.shape[0]):
        sub = dataclasses.replace(call, output=call.output[t:t + 1], hidden_states=call.hidden_states[t:t + 1],
                                  topk_weights=call.topk_weights[t:t + 1], topk_ids=call.topk_ids[t:t + 1],
                                  token_lora_mapping=call.token_lora_mapping[t:t + 1])
        run_experts(sub)


def batch_dependent(call):
    """Eager experts plus a last-bit change to the first row of an odd-sized batch: within every rounding bound,
    but a token's bits follow its batch's size and its place in it (as a tile or split-K choice can)."""
    run_experts(call)
    if call.output.shape[0] % 2:
        row = call.output[0]
        row.copy_(torch.nextafter(row, torch.full_like(row, float("inf"))))


def _spec(name, experts, invariant):
    caps = dataclasses.replace(EAGER.capabilities, batch_invariant=invariant, tensor_parallel=False)
    return dataclasses.replace(EAGER, name=name, experts=experts, capabilities=caps, op=None,
                               description=f"test backend {name}")


@pytest.mark.parametrize("view", VIEWED)
def test_a_view_s_truth_is_the_plain_truth_mapped(view):
    """The reference agrees with the property the view states (float64, to its rounding)."""
    _, plain, _ = expert_expectations(CASE, "one_shot")
    _, seen, _ = expert_expectations(CASE.replace(view=view), "one_shot")
    want = plain_rows(plain.value, view)
    assert seen.value.shape == want.shape
    assert torch.allclose(seen.value, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("activation", sorted(a for a in ACTIVATIONS if a not in UNSUPPORTED_ACTIVATIONS))
def test_the_reordered_views_truth_is_the_plain_truth_in_every_layout(activation):
    """The reordered view computes the same sums for every activation's w13 layout (split, interleaved, non-gated),
    with biases and LoRA: what lets the judge hold a twin run to the plain case's truth."""
    case = CASE.replace(activation=activation, bias=True, H=48, I=40)
    _, plain, _ = expert_expectations(case, "one_shot")
    _, seen, _ = expert_expectations(case.replace(view="reordered"), "one_shot")
    assert torch.allclose(seen.value, plain_rows(plain.value, "reordered"), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("quant", ["fp8_w8a8", "fp8_block"])
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])     # w13 split and interleaved
def test_the_reordered_view_of_fp8_weights_moves_their_codes_scales_and_blocks_whole(quant, activation):
    """FP8 weights' codes and scales follow the view's orders, fp8_block's 128-blocks and activation groups as units
    (the emulation, quantization included, is the plain one's in the view's columns, bit for bit), and the
    dequantized weights the reference reads are still code x scale: what the FP8 twin run rests on."""
    from moe_lora_harness.harness.build.properties import view_blocks
    from moe_lora_harness.reference.fp8 import dequantize_weights
    case = CASE.replace(quant=quant, activation=activation, dtype="float16", H=384, I=384, T=9)   # 3 blocks: all move
    plain, reo = build_expert_inputs(case), build_expert_inputs(case.replace(view="reordered"))
    w13_q, w13_s, w2_q, w2_s = reo.quantized
    for codes, scales, w in ((w13_q, w13_s, reo.w13), (w2_q, w2_s, reo.w2)):
        assert bit_equal(dequantize_weights(codes, scales, quant, w.dtype), w)
    assert not bit_equal(reo.quantized[1], plain.quantized[1])     # the scales moved
    blocks = view_blocks(quant)[0]
    pi = contraction_order(case.H, blocks)
    assert not bit_equal(pi, torch.arange(case.H))
    if blocks:   # whole blocks: each 128 of the view's positions come from one block of the plain's
        assert bool(((pi.reshape(-1, 128) // 128) == (pi.reshape(-1, 128)[:, :1] // 128)).all())
    _, plain_truth, plain_emu = expert_expectations(case, "one_shot")
    _, seen_truth, seen_emu = expert_expectations(case.replace(view="reordered"), "one_shot")
    assert bit_equal(seen_emu.value, plain_rows(plain_emu.value, "reordered", quant))
    assert torch.allclose(seen_truth.value, plain_rows(plain_truth.value, "reordered", quant), rtol=1e-12, atol=1e-12)
    x = torch.randn(3, case.H)
    assert bit_equal(plain_columns(plain_rows(x, "reordered", quant), quant), x)


@pytest.mark.parametrize("tp,fully_sharded", [(2, False), (2, True), (4, True)])
def test_a_tp_cases_reordered_view_permutes_within_each_ranks_shard(tp, fully_sharded):
    """Under TP each rank holds I's positions (and, fully sharded, H's) of its own shard: the view permutes within
    each, so every rank holds the same values and sums them in another order. Its emulation (each rank's partial
    output rounded, then all-reduced) is the plain one's in the view's columns bit for bit, which a permutation across
    the shards would not keep: the twin of a TP case measures its accumulation alone."""
    case = CASE.replace(tp_size=tp, fully_sharded=fully_sharded, H=64, I=48, max_rank=8, T=9)
    for n in (case.H, case.I):
        order, s = contraction_order(n, (), tp), n // tp
        assert not bit_equal(order, torch.arange(n))
        assert bool((order.reshape(tp, s) // s == torch.arange(tp)[:, None]).all())    # each shard stays in place
    _, plain_truth, plain_emu = expert_expectations(case, "one_shot")
    _, seen_truth, seen_emu = expert_expectations(case.replace(view="reordered"), "one_shot")
    assert bit_equal(seen_emu.value, plain_rows(plain_emu.value, "reordered", shards=tp))
    assert torch.allclose(seen_truth.value, plain_rows(plain_truth.value, "reordered", shards=tp), rtol=1e-12,
                          atol=1e-12)
    x = torch.randn(3, case.H)
    assert bit_equal(plain_columns(plain_rows(x, "reordered", shards=tp), shards=tp), x)
    with pytest.raises(ValueError, match="TP shard"):
        contraction_order(30, (), 4)


def test_the_reordered_view_rejects_packed_integer_weights():
    case = CASE.replace(quant="int4_g128", H=128, I=128, dtype="float16", view="reordered")
    assert any("view='reordered'" in p for p in case.problems())
    assert not CASE.replace(quant="fp8_block", H=128, I=128, dtype="float16", view="reordered").problems()


def test_views_change_only_what_they_say():
    plain = build_expert_inputs(CASE)
    half = build_expert_inputs(CASE.replace(view="half"))
    n = half_tokens(CASE.T)
    assert half.hidden.shape[0] == n and bit_equal(half.hidden, plain.hidden[:n]) and bit_equal(half.w13, plain.w13)
    rev = build_expert_inputs(CASE.replace(view="reversed"))
    assert bit_equal(rev.topk_ids, plain.topk_ids.flip(0)) and bit_equal(rev.token_lora_mapping,
                                                                        plain.token_lora_mapping.flip(0))
    rot = build_expert_inputs(CASE.replace(view="slots_rotated"))
    m, mr = plain.token_lora_mapping, rot.token_lora_mapping
    assert bit_equal(mr, torch.where(m >= 0, (m + 1) % CASE.max_loras, m).to(m.dtype))
    for s in range(CASE.max_loras):
        assert bit_equal(rot.stacked.w13_b[0][(s + 1) % CASE.max_loras], plain.stacked.w13_b[0][s])
    assert (mr >= 0).any() and (mr != m).any(), "the case must map tokens to slots for the view to show anything"
    reo = build_expert_inputs(CASE.replace(view="reordered"))
    pi, si = contraction_order(CASE.H), contraction_order(CASE.I)
    assert not bit_equal(pi, torch.arange(CASE.H)) and not bit_equal(si, torch.arange(CASE.I))
    assert bit_equal(reo.hidden, plain.hidden[:, pi]) and bit_equal(reo.topk_ids, plain.topk_ids)
    assert bit_equal(reo.w13, plain.w13[:, torch.cat([si, si + CASE.I])][:, :, pi])     # gate and up alike
    assert bit_equal(reo.w2, plain.w2[:, pi][:, :, si])
    assert bit_equal(reo.stacked.w13_a[1], plain.stacked.w13_a[1][..., pi])
    assert bit_equal(reo.stacked.w13_b[0], plain.stacked.w13_b[0][:, :, si])
    assert bit_equal(reo.stacked.w2_a[0], plain.stacked.w2_a[0][..., si])
    assert bit_equal(reo.stacked.w2_b[0], plain.stacked.w2_b[0][:, :, pi])
    x = torch.randn(3, CASE.H)
    assert bit_equal(plain_columns(plain_rows(x, "reordered")), x)


@pytest.mark.parametrize("view", TOKEN_VIEWS)
def test_declared_invariance_is_held_both_ways(view):
    case = CASE.replace(view=view)
    ok = run_case(_spec("per-token", per_token, True), case, "cpu", executor=InProcess(), reruns=0)
    assert ok.status == "pass", ok.detail
    if view == "slots_rotated":   # the batch is the same: a size-dependent change is the same bits in both runs
        return
    bad = run_case(_spec("batch-dependent", batch_dependent, True), case, "cpu", executor=InProcess(), reruns=0)
    assert bad.status == "fail" and bad.kind == "not-invariant", bad.detail
    assert "REPRO:" in bad.detail and '"view"' in bad.detail


def test_the_reordered_view_claims_values_not_bits():
    """Another summation order may change the last bits of a batch-invariant backend: the view's output is judged
    against its reference alone, and passes; its values are held to the reference like any case's."""
    case = CASE.replace(view="reordered")
    out = run_case(_spec("per-token", per_token, True), case, "cpu", executor=InProcess(), reruns=0)
    assert out.status == "pass" and not out.reason, out.detail
    bad = run_case(_spec("batch-dependent", batch_dependent, True), case, "cpu", executor=InProcess(), reruns=0)
    assert bad.status == "pass", bad.detail


def test_an_undeclared_backend_is_noted_never_failed():
    case = CASE.replace(view="half")
    same = run_case(_spec("per-token-undeclared", per_token, False), case, "cpu", executor=InProcess(), reruns=0)
    assert same.status == "pass" and "could be declared" in same.reason
    differs = run_case(_spec("batch-dependent-undeclared", batch_dependent, False), case, "cpu",
                       executor=InProcess(), reruns=0)
    assert differs.status == "pass" and not differs.reason, differs.detail


@pytest.mark.parametrize("which", ["w13", "w2"])
@pytest.mark.parametrize("shared", [{}, {"shared_a": True, "shared_b": True}, {"fully_sharded": True}])
def test_an_op_level_reordered_view_permutes_k_scales_b_and_keeps_the_outputs_columns(which, shared):
    """The op level's reordered view: x and every LoRA A take one permutation of K, every LoRA B is the plain one times
    OP_TWIN_B_SCALE rounded to its dtype (a shared A or B stays one stride-0 view), the rest is the plain case's; its
    truth is its own (the plain delta times the factor, to the B's rounding), where it lies (plain_columns: no move)."""
    from moe_lora_harness.harness.build.builders import build_op_inputs
    from moe_lora_harness.harness.build.properties import OP_TWIN_B_SCALE
    from moe_lora_harness.harness.judge.expectation import op_expectations
    case = Case(level="op", T=9, H=48, I=40, E=4, top_k=2, max_loras=3, max_rank=4, mapping="mixed", seed=5,
                dtype="float32", which=which, **shared)
    assert not case.replace(view="reordered").problems()
    plain, seen = build_op_inputs(case), build_op_inputs(case.replace(view="reordered"))
    pi = contraction_order(case.K)
    assert torch.equal(seen.x, plain.x[:, pi]) and not torch.equal(seen.x, plain.x)
    for a, b in zip(seen.lora_a, plain.lora_a):
        assert torch.equal(a, b[..., pi]) and a.stride(1) == b.stride(1)
    for a, b in zip(seen.lora_b, plain.lora_b):
        assert torch.equal(a, (b * OP_TWIN_B_SCALE).to(b.dtype)) and a.stride(1) == b.stride(1) and a.dtype == b.dtype
        assert not torch.equal(a, b)
    assert torch.equal(seen.output, plain.output)
    _, truth, _ = op_expectations(case, "one_shot")
    _, truth_seen, _ = op_expectations(case.replace(view="reordered"), "one_shot")
    assert torch.equal(plain_columns(truth_seen.value, level="op"), truth_seen.value)
    assert torch.equal(plain_rows(truth.value, "reordered", level="op"), truth.value)
    before = plain.output.to(torch.float64)
    delta, delta_seen = truth.value - before, truth_seen.value - before
    assert torch.allclose(delta_seen, OP_TWIN_B_SCALE * delta, rtol=1e-6, atol=1e-6 * float(delta.abs().max()))
    assert not torch.allclose(delta_seen, delta, rtol=1e-3, atol=0)


def test_a_view_is_an_expert_level_setting_of_one_rank():
    assert Case(level="op", view="half").problems() and not Case(level="op", view="reordered").problems()
    assert CASE.replace(view="sideways").problems()
    assert CASE.replace(view="half", tp_size=2).problems()
    assert CASE.replace(view="slots_rotated", max_loras=1).problems()
    assert not CASE.replace(view="half").problems()
    assert CASE.replace(view="reordered", quant="fp8_w8a8").problems()       # a block's scale would not follow K
    assert not CASE.replace(view="reordered", T=8, call_tokens=4).problems()  # the calls keep their tokens
    # a token view of one token is the token; the reordered view of one permutes its sums (a one-token twin run)
    assert CASE.replace(view="half", T=1).problems() and not CASE.replace(view="reordered", T=1).problems()
    # under TP the view keeps every rank's shard of H: shards that do not divide H are refused, naming both
    bad = CASE.replace(view="reordered", tp_size=2, H=CASE.H + 1).problems()
    assert any("H (" in p and "tp_size (2)" in p for p in bad), bad
    assert CASE.replace(view="half", T=8, call_tokens=4).problems()
