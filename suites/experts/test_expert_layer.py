"""The modular expert layer's structure: the LoRA context is passed explicitly (no global state), the mixin
runs at spec 5's two points in order, LoRA-off equals the base bit for bit, Marlin's LoRA enters through
its wrapper's closures, and the OAI permuted-layout LoRA agrees with the Triton experts under the error model.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import moe_lora_harness.kernels.experts.marlin_experts as marlin_mod
from moe_lora_harness.backends.experts import config_from_call, context_from_call
from moe_lora_harness.harness.build.builders import build_expert_inputs
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.judge.compare import compare_written
from moe_lora_harness.harness.build.expert_runner import expert_expectations
from moe_lora_harness.kernels.experts.lora_mixin import build_lora_alignment
from moe_lora_harness.kernels.experts.marlin_experts import MarlinExperts
from moe_lora_harness.kernels.experts.modular import FusedMoEKernel
from moe_lora_harness.kernels.experts.oai_experts import OAIExperts
from moe_lora_harness.kernels.experts.prepare_finalize import NoEPPrepareAndFinalize
from moe_lora_harness.kernels.experts.triton_experts import TritonExperts
from moe_lora_harness.kernels.triton.quant_gemm import pack_weights


def _dtype(device):
    return "bfloat16" if str(device).startswith("cuda") else "float16"


def _case(device, **kw):
    base = dict(level="expert", T=6, H=64, I=48, E=4, top_k=2, max_loras=3, max_rank=8, dtype=_dtype(device),
                seed=11)
    return Case(**dict(base, **kw))


def _setup(case, device):
    """(call, config, ctx) for an expert-level case on `device`."""
    call = build_expert_inputs(case).call(device)
    cfg = config_from_call(call)
    return call, cfg, context_from_call(call, cfg)


def _weights(call):
    if call.quant == "none":
        return call.w13, call.w2
    return (pack_weights(call.w13_q, call.w13_scales, call.quant), pack_weights(call.w2_q, call.w2_scales, call.quant))


def _run(cls, call, cfg, ctx, *, experts=None):
    """Output of FusedMoEKernel(no-EP prepare/finalize, cls(cfg)) on the call, with `ctx` (None = no LoRA)."""
    if ctx is None and cfg.lora_enabled:
        cfg = dataclasses.replace(cfg, lora_enabled=False, max_lora_rank=0, fully_sharded=False)
    kernel = FusedMoEKernel(NoEPPrepareAndFinalize(), experts or cls(cfg))
    w13, w2 = _weights(call)
    return kernel.apply(call.hidden_states, w13, w2, call.topk_weights, call.topk_ids, lora_ctx=ctx,
                        expert_map=call.expert_map, w13_bias=call.w13_bias, w2_bias=call.w2_bias)


def _bits_equal(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16)) if a.element_size() == 2 \
        else torch.equal(a, b)


# ----------------------------------------------------------------------------- explicit context


def test_two_kernels_with_different_contexts_keep_their_own_answers(device):
    case = _case(device, mapping="mixed")
    call, cfg, ctx1 = _setup(case, device)
    _, _, ctx2 = _setup(case.replace(seed=case.seed + 1), device)   # other adapters and mapping
    k1 = FusedMoEKernel(NoEPPrepareAndFinalize(), TritonExperts(cfg))
    k2 = FusedMoEKernel(NoEPPrepareAndFinalize(), TritonExperts(cfg))
    args = (call.hidden_states, call.w13, call.w2, call.topk_weights, call.topk_ids)
    solo1 = k1.apply(*args, lora_ctx=ctx1).clone()
    solo2 = k2.apply(*args, lora_ctx=ctx2).clone()
    assert not _bits_equal(solo1, solo2), "the two contexts must give different answers for the test to mean anything"
    for _ in range(2):   # interleaved calls: nothing of one context leaks into the other kernel
        assert _bits_equal(k2.apply(*args, lora_ctx=ctx2), solo2)
        assert _bits_equal(k1.apply(*args, lora_ctx=ctx1), solo1)
    shared = TritonExperts(cfg)   # one experts object, two contexts: still each its own answer
    assert _bits_equal(_run(None, call, cfg, ctx2, experts=shared), solo2)
    assert _bits_equal(_run(None, call, cfg, ctx1, experts=shared), solo1)
    assert ctx1.original_hidden_states is None and ctx2.original_hidden_states is None


class _Spy(TritonExperts):
    """TritonExperts recording each phase and mixin call (and the inputs that matter) in order."""

    def __init__(self, config, log):
        super().__init__(config)
        self.log = log

    def base_w13(self, plan, x, out):
        self.log.append(("base_w13", x))
        super().base_w13(plan, x, out)

    def apply_w13_lora(self, ctx, **kw):
        self.log.append(("apply_w13_lora", kw["x"], ctx.original_hidden_states))
        return super().apply_w13_lora(ctx, **kw)

    def activation(self, plan, cache1, cache2):
        self.log.append(("activation",))
        super().activation(plan, cache1, cache2)

    def base_w2(self, plan, cache2, out):
        self.log.append(("base_w2",))
        super().base_w2(plan, cache2, out)

    def apply_w2_lora(self, ctx, **kw):
        self.log.append(("apply_w2_lora", kw["x"]))
        return super().apply_w2_lora(ctx, **kw)

    def moe_sum(self, plan, cache3, output):
        self.log.append(("moe_sum",))
        super().moe_sum(plan, cache3, output)


def test_mixin_runs_at_the_two_points_with_the_original_hidden_states(device):
    case = _case(device, top_k=1, apply_router_weight_on_input=True)
    call, cfg, ctx = _setup(case, device)
    # top_k 1 routing from the builders has weight 1.0 (a softmax over one logit): use weights that matter
    g = torch.Generator().manual_seed(5)
    call = dataclasses.replace(call, topk_weights=(0.2 + 0.7 * torch.rand(case.T, 1, generator=g)).to(device))
    log = []
    _run(None, call, cfg, ctx, experts=_Spy(cfg, log))
    assert [e[0] for e in log] == ["base_w13", "apply_w13_lora", "activation", "base_w2", "apply_w2_lora", "moe_sum"]
    base_x, (_, lora_x, stashed) = log[0][1], log[1]
    assert lora_x is call.hidden_states and stashed is call.hidden_states   # unweighted input for the LoRA
    assert not torch.equal(base_x, call.hidden_states)                      # the base GEMM got x * w
    assert log[4][1].shape == (case.T * case.top_k, case.I)                 # w2 LoRA reads the activation output
    assert ctx.original_hidden_states is None                               # restored after the call


@pytest.mark.parametrize("cls,extra", [
    (TritonExperts, dict(activation="silu", ep_size=2, ep_rank=1, E=8)),
    (OAIExperts, dict(activation="swigluoai", bias=True)),
    (MarlinExperts, dict(activation="silu", quant="int8_channel")),
], ids=["triton", "oai", "marlin"])
def test_lora_off_equals_base_bit_exact(device, cls, extra):
    case = _case(device, **extra)
    call, cfg, ctx = _setup(case, device)
    if not cls.is_supported_config(cfg)[0]:
        pytest.skip(f"{cls.name}: {cls.is_supported_config(cfg)[1]}")
    base = _run(cls, call, cfg, None)
    no_tokens = dataclasses.replace(ctx, token_lora_mapping=torch.full_like(ctx.token_lora_mapping, -1),
                                    local_token_lora_mapping=None if ctx.local_token_lora_mapping is None else
                                    torch.full_like(ctx.local_token_lora_mapping, -1))
    no_slots = dataclasses.replace(ctx, adapter_enabled=torch.zeros_like(ctx.adapter_enabled))
    with_lora = _run(cls, call, cfg, ctx)
    assert not _bits_equal(with_lora, base), "the LoRA must change the output for the comparison to mean anything"
    assert _bits_equal(_run(cls, call, cfg, no_tokens), base)
    assert _bits_equal(_run(cls, call, cfg, no_slots), base)


# ----------------------------------------------------------------------------- Marlin's closures


def test_marlin_lora_goes_through_the_wrapper_closures(device, monkeypatch):
    case = _case(device, quant="int8_channel", mapping="mixed")
    call, cfg, ctx = _setup(case, device)
    log = []

    def spy(name, fn):
        def wrapped(*a, **kw):
            log.append(name)
            return fn(*a, **kw)
        return wrapped

    wrapper = marlin_mod.fused_marlin_moe
    hooks_seen = {}

    def spy_wrapper(*a, **kw):
        hooks_seen.update(act=kw.get("activation_fn"), sum=kw.get("moe_sum_fn"))
        log.append("wrapper")
        return wrapper(*a, **kw)

    monkeypatch.setattr(marlin_mod, "fused_marlin_moe", spy_wrapper)
    monkeypatch.setattr(marlin_mod, "fused_moe_gemm", spy("gemm", marlin_mod.fused_moe_gemm))
    monkeypatch.setattr(marlin_mod, "torch_activation", spy("activation", marlin_mod.torch_activation))
    monkeypatch.setattr(marlin_mod, "moe_sum", spy("moe_sum", marlin_mod.moe_sum))
    monkeypatch.setattr(MarlinExperts, "apply_w13_lora", spy("w13_lora", MarlinExperts.apply_w13_lora))
    monkeypatch.setattr(MarlinExperts, "apply_w2_lora", spy("w2_lora", MarlinExperts.apply_w2_lora))
    out = _run(MarlinExperts, call, cfg, ctx)
    assert log == ["wrapper", "gemm", "w13_lora", "activation", "gemm", "w2_lora", "moe_sum"]
    assert callable(hooks_seen["act"]) and callable(hooks_seen["sum"])
    log.clear()
    _run(MarlinExperts, call, cfg, None)
    assert log == ["wrapper", "gemm", "activation", "gemm", "moe_sum"] and hooks_seen["act"] is None
    monkeypatch.undo()
    # the closures add the deltas where the Triton phases do: same answer as the Triton experts run on the
    # dequantized weights (the quantized GEMM dequantizes to exactly those values)
    dense = _run(TritonExperts, dataclasses.replace(call, quant="none"), dataclasses.replace(cfg, quant="none"), ctx)
    if device == "cpu":   # the interpreter's dot is deterministic: bit-identical by construction
        assert _bits_equal(out, dense)
    truth_inp, truth, emu = expert_expectations(case, MarlinExperts.lora_path(cfg, case.T, case.max_loras))
    v = compare_written(out, truth.value, emu.value, truth.scale, torch.ones(case.T, case.H, dtype=torch.bool),
                        dtype=call.hidden_states.dtype, k_plus_r=case.H + case.I + case.max_rank, names=("t", "h"))
    assert v.ok, v.message


def test_fused_marlin_moe_hooks_replace_the_activation_and_the_sum(device):
    case = _case(device, quant="int8_channel", lora=False)
    call, cfg, _ = _setup(case, device)
    w13, w2 = _weights(call)
    seen = {}

    def act(cache1, cache2):
        seen["act"] = (tuple(cache1.shape), tuple(cache2.shape))
        cache2.fill_(1.0)

    def total(cache3, out, cache2):
        seen["sum"] = (tuple(cache3.shape), tuple(out.shape), bool((cache2 == 1).all()))
        out.fill_(3.0)

    out = torch.full_like(call.hidden_states, float("nan"))
    marlin_mod.fused_marlin_moe(call.hidden_states, w13, w2, call.topk_weights, call.topk_ids, activation="silu",
                                output=out, activation_fn=act, moe_sum_fn=total)
    P = case.T * case.top_k
    assert seen == {"act": ((P, 2 * case.I), (P, case.I)), "sum": ((P, case.H), (case.T, case.H), True)}
    assert bool((out == 3).all())


# ----------------------------------------------------------------------------- OAI permuted layout


class _OAIUnpermutedMapping(OAIExperts):
    """Planted bug: the token->LoRA map is read in pair order instead of through the permutation."""

    def _permuted_lora_inputs(self, ctx, hidden_states, topk_weights, topk_ids, expert_map, perm):
        d = super()._permuted_lora_inputs(ctx, hidden_states, topk_weights, topk_ids, expert_map, perm)
        wrong = ctx.mapping.repeat_interleave(self.config.top_k)[:perm.numel()].contiguous()
        d["align"] = build_lora_alignment(ctx, d["ids"], expert_map=expert_map is not None, mapping=wrong,
                                          path=d["align"].path)
        return d


def _oai_vs_triton(cls, case, device):
    call, cfg, ctx = _setup(case, device)
    oai = _run(cls, call, cfg, ctx)
    tri = _run(TritonExperts, call, cfg, ctx)
    _, truth, _ = expert_expectations(case, "exact")
    return compare_written(oai, truth.value, tri.cpu().double(), truth.scale,
                           torch.ones(case.T, case.H, dtype=torch.bool), dtype=call.hidden_states.dtype,
                           k_plus_r=case.H + case.I + case.max_rank, names=("t", "h"))


@pytest.mark.parametrize("extra", [dict(mapping="mixed", bias=True), dict(ep_size=2, ep_rank=0, E=8),
                                   dict(shared_a=True, shared_b=True, T=9)], ids=["mixed-bias", "ep", "shared"])
def test_oai_permuted_lora_matches_triton_within_the_error_model(device, extra):
    case = _case(device, activation="swigluoai", **extra)
    v = _oai_vs_triton(OAIExperts, case, device)
    assert v.ok, v.message


def test_oai_comparison_catches_a_mapping_not_permuted(device):
    case = _case(device, activation="swigluoai", mapping="mixed", T=8)
    v = _oai_vs_triton(_OAIUnpermutedMapping, case, device)
    assert not v.ok, "a LoRA applied to the wrong tokens must fail the comparison"


# ----------------------------------------------------------------------------- bad input


def test_bad_input_is_named_before_any_launch(device, monkeypatch):
    monkeypatch.delenv("MOE_LORA_UNCHECKED", raising=False)   # the id-range check is part of what is tested
    case = _case(device)
    call, cfg, ctx = _setup(case, device)
    k = FusedMoEKernel(NoEPPrepareAndFinalize(), TritonExperts(cfg))
    args = [call.hidden_states, call.w13, call.w2, call.topk_weights, call.topk_ids]
    with pytest.raises(ValueError, match="w13 must have shape"):
        k.apply(args[0], call.w13[:, :-1], *args[2:], lora_ctx=ctx)
    with pytest.raises(TypeError, match="topk_ids must have dtype"):
        k.apply(*args[:4], call.topk_ids.long(), lora_ctx=ctx)
    with pytest.raises(ValueError, match="lora_ctx must be a MoELoRAContext"):
        k.apply(*args)
    with pytest.raises(ValueError, match="topk_ids must hold expert ids"):
        k.apply(*args[:4], torch.full_like(call.topk_ids, 99), lora_ctx=ctx)
    with pytest.raises(ValueError, match="token_lora_mapping must hold slots"):
        k.apply(*args, lora_ctx=dataclasses.replace(ctx, token_lora_mapping=torch.full_like(ctx.token_lora_mapping, 9)))
    with pytest.raises(ValueError, match="w13_lora_a_stacked must hold 2 slice"):
        dataclasses.replace(ctx, w13_lora_a_stacked=ctx.w13_lora_a_stacked[:1])
    with pytest.raises(TypeError, match="adapter_enabled must be an int32"):
        dataclasses.replace(ctx, adapter_enabled=ctx.adapter_enabled.long())
    with pytest.raises(ValueError, match="tp_rank"):
        dataclasses.replace(ctx, tp_rank=1)
    with pytest.raises(ValueError, match="enable_moe_shared_loras"):
        dataclasses.replace(ctx, w2_lora_b_stacked=[ctx.w2_lora_b_stacked[0][:, :1].contiguous()])
    with pytest.raises(TypeError, match="QuantWeights"):
        _run(MarlinExperts, call, dataclasses.replace(cfg, quant="int8_channel"), ctx)


@pytest.mark.parametrize("cls,extra", [(TritonExperts, {}), (OAIExperts, dict(activation="swigluoai")),
                                       (MarlinExperts, dict(quant="int8_channel"))], ids=["triton", "oai", "marlin"])
def test_empty_batch(device, cls, extra):
    call, cfg, ctx = _setup(_case(device, T=0, **extra), device)
    assert _run(cls, call, cfg, ctx).shape == (0, cfg.H)


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_sparse_batch_takes_the_naive_small_batch_path_and_conforms(device, activation):
    """T*k*8 <= E*L: naive block assignment, hence the small-batch kernel's single rounding (declared
    as this backend's precision for the case, so the harness compares against that rounding model)."""
    from moe_lora_harness.backends.experts import TRITON_EXPERTS
    from moe_lora_harness.harness.execution.runner import run_case
    case = _case(device, T=1, E=16, activation=activation, mapping="uniform")
    assert TRITON_EXPERTS.precision_for(case, "cpu") == "small_batch"
    out = run_case(TRITON_EXPERTS, case, device)
    assert out.status == "pass", out.detail or out.reason


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_fully_sharded_single_rank_takes_the_two_kernel_path(device, activation):
    """One TP rank with fully sharded LoRA: the two-kernel op (its collectives are identities on one rank)."""
    from moe_lora_harness.backends.experts import TRITON_EXPERTS
    from moe_lora_harness.harness.execution.runner import run_case
    case = _case(device, activation=activation, fully_sharded=True)
    assert TRITON_EXPERTS.precision_for(case, "cpu") == "two_kernel"
    out = run_case(TRITON_EXPERTS, case, device)
    assert out.status == "pass", out.detail or out.reason
