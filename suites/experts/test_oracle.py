"""The experts oracle chooses from declarations only: whatever it returns supports the config, it never
lets LoRA skip a capability check (vLLM 0.33.0's early-return bug), and "nothing fits" lists every reason.
A planted oracle with the LoRA early return is caught by the same property, so the property can fail."""
from __future__ import annotations

import pytest
import torch
from hypothesis import find, given
from hypothesis import strategies as st

from moe_lora_harness.harness.draw.strategies import suite_settings
from moe_lora_harness.kernels.experts.config import MoEConfig
from moe_lora_harness.kernels.experts.gated_fast_experts import GatedFastExperts
from moe_lora_harness.kernels.experts.oracle import BACKEND_PRIORITY, NoBackendError, explain, select_experts
from moe_lora_harness.kernels.experts.triton_experts import TritonExperts

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai", "swigluoai_uninterleave", "swiglustep", "situ",
               "silu_no_mul", "gelu_no_mul", "gelu_tanh_no_mul", "relu2_no_mul", "relu2")
SETTINGS = suite_settings(max_examples=300, database=None)


@st.composite
def configs(draw, activation=None, lora=None, I=None):
    """Any well-formed MoEConfig (sizes around the backends' shape rules)."""
    lora_enabled = draw(st.booleans()) if lora is None else lora
    top_k = draw(st.sampled_from((1, 2, 4)))
    return MoEConfig(
        device=draw(st.sampled_from(("cpu", "cuda"))),
        dtype=draw(st.sampled_from((torch.float16, torch.bfloat16, torch.float32))),
        activation=activation or draw(st.sampled_from(ACTIVATIONS)),
        H=draw(st.sampled_from((64, 96, 128, 256))),
        I=I or draw(st.sampled_from((48, 96, 128, 256, 384))),
        E=draw(st.sampled_from((4, 8, 64, 1000))),
        top_k=top_k,
        has_bias=draw(st.booleans()),
        quant=draw(st.sampled_from(("none", "none", "int4_g128", "int8_channel"))),
        lora_enabled=lora_enabled,
        max_lora_rank=draw(st.sampled_from((8, 64, 256))) if lora_enabled else 0,
        expert_map=draw(st.booleans()),
        fully_sharded=lora_enabled and draw(st.booleans()),
        apply_router_weight_on_input=top_k == 1 and draw(st.booleans()))


def violation(select, config) -> str | None:
    """Why `select`'s answer for `config` breaks the oracle's contract (None = it keeps it)."""
    rows = explain(config)
    try:
        cls = select(config)
    except NoBackendError as e:
        if any(ok for _, ok, _ in rows):
            return f"raised although {[n for n, ok, _ in rows if ok]} support it"
        missing = [n for n, _, why in rows if n not in str(e) or why not in str(e)]
        return f"error message lacks {missing}" if missing else None
    ok, why = cls.is_supported_config(config)
    if not ok:
        return f"chose {cls.name}, which declines it: {why}"
    first = next(c for c, (_, ok, _) in zip(BACKEND_PRIORITY, rows) if ok)
    if cls is not first:
        return f"chose {cls.name} over the higher-priority {first.name}"
    return None


def vllm_lora_early_return(config):
    """A planted oracle with vLLM 0.33.0's bug: with LoRA it returns before the capability checks."""
    if config.lora_enabled:
        return GatedFastExperts if config.device == "cuda" and config.I % 128 == 0 else TritonExperts
    return select_experts(config)


@SETTINGS
@given(configs())
def test_chosen_backend_supports_the_config(config):
    assert violation(select_experts, config) is None, violation(select_experts, config)


@SETTINGS
@given(configs(activation="relu2_no_mul", lora=True, I=128))
def test_non_gated_lora_never_reaches_the_gated_only_backend(config):
    try:
        cls = select_experts(config)
    except NoBackendError:
        return
    assert cls is not GatedFastExperts and cls.is_supported_config(config)[0]


@SETTINGS
@given(configs(activation="silu", lora=True, I=96) | configs(activation="silu", I=48))
def test_intermediate_not_multiple_of_128_never_reaches_the_fast_backend(config):
    try:
        assert select_experts(config) is not GatedFastExperts
    except NoBackendError:
        pass


def test_fast_backend_is_chosen_where_it_fits():
    """The priority is real: a gated-SiLU 16-bit config with I % 128 == 0 goes to the fast path (LoRA or not)."""
    for lora in (False, True):
        cfg = MoEConfig("cuda", torch.bfloat16, "silu", 256, 384, 8, 2, lora_enabled=lora,
                        max_lora_rank=16 if lora else 0)
        assert select_experts(cfg) is GatedFastExperts
    cfg = MoEConfig("cuda", torch.bfloat16, "relu2_no_mul", 256, 384, 8, 2, lora_enabled=True, max_lora_rank=16)
    assert select_experts(cfg) is TritonExperts


def test_unsupported_config_lists_every_backend_and_reason():
    cfg = MoEConfig("cuda", torch.float32, "relu2", 128, 128, 8, 2, quant="int8_channel")
    rows = explain(cfg)
    assert [n for n, _, _ in rows] == [c.name for c in BACKEND_PRIORITY]
    assert not any(ok for _, ok, _ in rows)
    with pytest.raises(NoBackendError) as info:
        select_experts(cfg)
    for name, _, why in rows:
        assert why and name in str(info.value) and why in str(info.value)


def test_checks_run_in_the_declared_order():
    """Device before activation before quant before LoRA: the first failing declaration is the reason."""
    cfg = MoEConfig("cuda", torch.float16, "relu2_no_mul", 64, 96, 4, 2, quant="int4_g128", lora_enabled=True,
                    max_lora_rank=8)
    ok, why = GatedFastExperts.is_supported_config(cfg)
    assert not ok and why.startswith("non-gated activation relu2_no_mul")
    ok, why = TritonExperts.is_supported_config(cfg)
    assert not ok and why.startswith("quant scheme int4_g128")


def test_planted_lora_early_return_is_caught_by_the_same_property():
    bad = find(configs(), lambda c: violation(vllm_lora_early_return, c) is not None,
               settings=suite_settings(max_examples=2000, database=None))
    assert bad.lora_enabled, bad
    assert "declines it" in violation(vllm_lora_early_return, bad)
    # and the headline symptom: a non-gated activation sent to the gated-only kernel
    cfg = MoEConfig("cuda", torch.bfloat16, "relu2_no_mul", 128, 128, 8, 2, lora_enabled=True, max_lora_rank=16)
    assert vllm_lora_early_return(cfg) is GatedFastExperts
    assert "non-gated" in violation(vllm_lora_early_return, cfg)


def test_bad_config_is_rejected_with_the_field_named():
    with pytest.raises(ValueError, match="MoEConfig.quant"):
        MoEConfig("cuda", torch.float16, "silu", 64, 64, 4, 2, quant="fp8")
    with pytest.raises(ValueError, match="apply_router_weight_on_input"):
        MoEConfig("cuda", torch.float16, "silu", 64, 64, 4, 2, apply_router_weight_on_input=True)
    with pytest.raises(ValueError, match="max_lora_rank"):
        MoEConfig("cuda", torch.float16, "silu", 64, 64, 4, 2, lora_enabled=True)
    with pytest.raises(TypeError, match="dtype"):
        MoEConfig("cuda", torch.int8, "silu", 64, 64, 4, 2)
    with pytest.raises(TypeError, match="MoEConfig"):
        explain("silu")
