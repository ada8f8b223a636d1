"""Decode calls (Case.call_tokens): a case's tokens handed to the backend in consecutive calls of the same layer.
Checked both ways: a correct backend passes split or whole, one that keeps the first call's mapping fails only split;
declarations and rounding models are asked about one call; pooling the calls' rows gives a decode batch a served
batch's power (rule 4), where one call of it alone cannot fail rule 4."""
from __future__ import annotations

import dataclasses

import pytest

from moe_lora_harness.backends.eager import BACKEND as EAGER
from moe_lora_harness.backends.eager import run_experts
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.contract import Rule, support_for
from moe_lora_harness.harness.execution.execute import InProcess
from moe_lora_harness.harness.execution.runner import repro_command, run_case

CASE = Case(level="expert", T=6, H=32, I=24, E=4, top_k=2, max_loras=3, max_rank=4, mapping="mixed", seed=11,
            dtype="float32", call_tokens=1)


class FirstMapping:
    """Eager experts that keep the token->LoRA mapping of their first call for a batch of the same size (a stale
    metadata cache keyed by the batch size, as a LoRA kernel's prepared mapping can be)."""

    def __init__(self):
        self.kept = {}

    def __call__(self, call):
        T = call.hidden_states.shape[0]
        mapping = self.kept.setdefault(T, call.token_lora_mapping.clone())
        run_experts(dataclasses.replace(call, token_lora_mapping=mapping))


def _stale_spec():
    return dataclasses.replace(EAGER, name="stale_mapping", experts=FirstMapping())


def test_call_tokens_is_validated_and_named():
    assert CASE.problems() == [] and CASE.calls == 6 and CASE.per_call().T == 1
    assert "calls6x1" in CASE.id
    assert Case.from_json(CASE.to_json()) == CASE
    assert any("must divide T" in p for p in CASE.replace(call_tokens=4).problems())
    assert any("expert-level setting of one rank" in p for p in CASE.replace(tp_size=2).problems())
    assert any("expert-level" in p for p in Case(level="op", T=4, call_tokens=2).problems())
    assert any("int >= 0" in p for p in CASE.replace(call_tokens=-1).problems())


def test_a_correct_backend_passes_split_or_whole():
    for case in (CASE, CASE.replace(call_tokens=0), CASE.replace(call_tokens=2), CASE.replace(dtype="float16")):
        out = run_case(EAGER, case, "cpu", executor=InProcess())
        assert out.status == "pass", (case.id, out.detail)


def test_a_stale_mapping_across_calls_fails_only_when_called_per_token():
    whole = run_case(_stale_spec(), CASE.replace(call_tokens=0), "cpu", executor=InProcess())
    assert whole.status == "pass", whole.detail         # one call: nothing to keep stale
    split = run_case(_stale_spec(), CASE, "cpu", executor=InProcess())
    assert split.status == "fail", split.detail
    assert "call_tokens" in split.repro and "call_tokens" in repro_command(EAGER, CASE, "cpu")
    from moe_lora_harness.harness.search.signatures import needed_axes
    assert ("calls", "True") in needed_axes(_stale_spec(), split, "cpu", InProcess())


def test_declarations_are_asked_about_one_call():
    """A rule on T sees the call's tokens, and so does a rounding model chosen by T."""
    small_only = dataclasses.replace(EAGER, capabilities=dataclasses.replace(
        EAGER.capabilities, rules=(Rule("decode only", lambda c: c.T <= 2, "runs batches of at most 2 tokens"),)),
        precision=lambda c: "one_shot" if c.T <= 2 else "two_kernel")
    assert support_for(small_only, CASE, "cpu")[0]
    assert not support_for(small_only, CASE.replace(call_tokens=0), "cpu")[0]
    assert small_only.precision_for(CASE, "cpu") == "one_shot"
    assert small_only.precision_for(CASE.replace(call_tokens=0), "cpu") == "two_kernel"


def _one_call_and_pooled(base: Case, calls: int = 32):
    """The scaling slip's judge threshold on one call of `base` and on `calls` such calls pooled (power.measure), the
    correct kernel passing both: (its SlipPower on one call, on the pooled calls, the pooled PowerReport)."""
    from moe_lora_harness.harness.selftest import power
    slips = [s for s in power.SLIPS if s.name == "scaling"]
    one = power.measure(EAGER, base, "cpu", slips=slips, steps=8)
    pooled = power.measure(EAGER, base.replace(T=base.T * calls, call_tokens=base.T), "cpu", slips=slips, steps=8)
    assert one.kernel_ok and pooled.kernel_ok
    (s1,), (sp,) = one.slips, pooled.slips
    assert s1.judge.multiple is not None and sp.judge.multiple is not None
    assert sp.oracle_only == 0
    return s1, sp, pooled


@pytest.mark.parametrize("dtype", ["float16"])
def test_pooled_calls_give_a_decode_batch_rule_4s_power(dtype):
    """The scaling slip (every B off by 1 - alpha) at 4 tokens: one call of them cannot fail rule 4 (4 rows), 32
    calls of 4 can: the single call needs rule 3's sqrt(3^2 - 1) = 2.83 times the kernel's own error (measured 2.9), the
    pooled ones fail well below it (measured 1.6 at 128 rows; more rows, less); the correct kernel passes both."""
    from moe_lora_harness.harness.selftest import power
    s1, sp, pooled = _one_call_and_pooled(Case(level="expert", T=4, H=256, I=128, E=4, top_k=2, max_rank=16,
                                               dtype=dtype, seed=3))
    assert sp.judge.multiple < 2.0 < 2.5 < s1.judge.multiple, (s1.judge.multiple, sp.judge.multiple)
    assert "T4x32calls" in power.power_table([pooled])


def test_the_check_matrix_decode_row_pools_enough_rows_for_rule_4():
    """On the GPU profile the decode row holds four times the rows rule 4 needs before it can fail; with --model each
    token count up to DECODE_MOST_TOKENS is one call's, pooled to as many rows, and a prefill count is dropped."""
    from moe_lora_harness.harness.judge.compare import EXCESS_MIN_ROWS, EXCESS_SIGMAS
    from moe_lora_harness.harness.check.features import DECODE_MOST_TOKENS, DECODE_ROW, DECODE_ROWS, FEATURES
    from moe_lora_harness.harness.check.model_plan import plan_model
    from moe_lora_harness.harness.served.models import model_named
    assert EXCESS_MIN_ROWS ** 0.5 >= EXCESS_SIGMAS > (EXCESS_MIN_ROWS - 1) ** 0.5
    assert DECODE_ROWS == 4 * EXCESS_MIN_ROWS
    row = next(f for f in FEATURES if f.name == DECODE_ROW)
    gpu = row.cases("cuda", 2)
    assert [(c.T, c.call_tokens) for c in gpu] == [(DECODE_ROWS, 1), (DECODE_ROWS, 2)]
    assert all(not c.problems() for c in gpu + row.cases("cpu", 1))
    plan = plan_model(model_named("Qwen3-30B-A3B"), {"eager": EAGER}, "cpu", [row],
                      tokens=(1, 7, DECODE_MOST_TOKENS + 1), budget=10 ** 13)
    calls = sorted({(c.per_call().T, c.T) for _, _, _, c in plan.runs})
    assert calls == [(1, DECODE_ROWS), (7, 7 * -(-DECODE_ROWS // 7))]
    assert any("decode calls hold" in why for _, _, why in plan.dropped)


@pytest.mark.parametrize("quant", ["fp8_block"])
def test_pooled_fp8_calls_give_a_decode_batch_rule_4s_power(quant):
    """The same with FP8 activations (fp16, 4 tokens a call): one call has rule 3 alone over a floor that allows a
    flip of GEMM2's quantized input in every row (measured 29 times the kernel's own error); 32 calls pooled let
    rule 4 judge the rows, each flip allowed its expected square (measured 3.3)."""
    s1, sp, _ = _one_call_and_pooled(Case(level="expert", T=4, H=256, I=256, E=4, top_k=2, max_rank=16,
                                          dtype="float16", quant=quant, seed=3))
    assert sp.judge.multiple < 5.0 < 15.0 < s1.judge.multiple, (s1.judge.multiple, sp.judge.multiple)


def test_model_mode_pools_the_fp8_rows_decode_calls_and_runs_block_fp8_at_a_layer_of_128_multiples():
    """With --model the FP8 rows' token counts up to DECODE_MOST_TOKENS are one call's each, pooled as the decode
    row's (a prefill count stays one call); the block row takes the layer's H and I where both are multiples of 128
    (DeepSeek-V3's own scheme at its own layer) and is not applicable elsewhere, naming the sizes; the check matrix's
    own FP8 cases keep their sizes on the CPU profile."""
    from moe_lora_harness.harness.check.features import DECODE_MOST_TOKENS, DECODE_ROWS, FEATURES
    from moe_lora_harness.harness.check.model_plan import plan_model
    from moe_lora_harness.harness.served.models import model_named
    fp8 = [f for f in FEATURES if f.name in ("experts: fp8 w8a8", "experts: fp8 block")]
    assert len(fp8) == 2 and all(f.pooled_decode for f in fp8)
    plan = plan_model(model_named("DeepSeek-V3"), {"eager": EAGER}, "cpu", fp8,
                      tokens=(1, 16, DECODE_MOST_TOKENS + 1), budget=10 ** 14)
    got = sorted({(feat, c.quant, c.per_call().T, c.T, c.H, c.I) for _, _, feat, c in plan.runs})
    for name, quant in (("experts: fp8 block", "fp8_block"), ("experts: fp8 w8a8", "fp8_w8a8")):
        assert [g[1:] for g in got if g[0] == name] == [
            (quant, 1, DECODE_ROWS, 7168, 2048), (quant, 16, 16 * -(-DECODE_ROWS // 16), 7168, 2048),
            (quant, DECODE_MOST_TOKENS + 1, DECODE_MOST_TOKENS + 1, 7168, 2048)]
    other = plan_model(model_named("GPT-OSS-20B"), {"eager": EAGER}, "cpu", fp8, tokens=(16,), budget=10 ** 14)
    assert "H=256 (the layer's: 2880)" in other.not_applicable["experts: fp8 block"]
    assert {(c.H, c.I) for c in fp8[1].cases("cpu", 2)} == {(256, 256)}
