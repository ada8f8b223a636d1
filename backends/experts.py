"""Expert-level backends of the modular expert layer (kernels/experts): one BackendSpec per experts class,
plus `experts_oracle`, which runs whatever kernels.experts.oracle.select_experts picks for the case.

Capabilities are translated from each class's declared data, and a final Rule asks the class's own
`is_supported_config` about the case, so what the harness believes a backend claims is exactly what the
backend declares. Rounding model: the LoRA op path the class takes (its `lora_path`).
"""
from __future__ import annotations

import torch

from moe_lora_harness.backends.rounding import TRITON_FP8_MMA, TRITON_POINTS_ONLY
from moe_lora_harness.harness.spec.case import FP8_QUANTS, Case
from moe_lora_harness.harness.spec.contract import BackendSpec, Capabilities, ExpertCall, Rule
from moe_lora_harness.kernels.dtypes import DTYPES

try:
    import triton  # noqa: F401
    from moe_lora_harness.kernels.experts import oracle
    from moe_lora_harness.kernels.experts.config import MoEConfig
    from moe_lora_harness.kernels.experts.lora_context import MoELoRAContext
    from moe_lora_harness.kernels.experts.modular import FusedMoEKernel
    from moe_lora_harness.kernels.experts.ep_prepare_finalize import NaiveEPPrepareAndFinalize, slice_lora_to_local
    from moe_lora_harness.kernels.experts.prepare_finalize import NoEPPrepareAndFinalize
    from moe_lora_harness.kernels.triton.quant_gemm import pack_weights
    _IMPORT_ERROR = ""
except Exception as e:  # noqa: BLE001 - declared, not hidden: every case reports this reason
    oracle = None
    _IMPORT_ERROR = f"expert kernels not importable: {type(e).__name__}: {e}"

def _here() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def config_from_case(case: Case, device: str | None = None) -> "MoEConfig":
    """The MoEConfig one rank of an expert-level case runs on `device` (cpu/cuda; default: this machine's)."""
    return MoEConfig(
        device=device or _here(), dtype=DTYPES[case.dtype], activation=case.activation, H=case.H,
        I=case.I // case.tp_size if case.I % case.tp_size == 0 else case.I,  # one TP rank's slice
        E=case.local_experts, top_k=case.top_k, has_bias=case.bias, quant=case.quant, lora_enabled=case.lora,
        max_lora_rank=case.max_rank if case.lora else 0, expert_map=case.ep_size > 1,
        fully_sharded=case.fully_sharded and case.lora,
        apply_router_weight_on_input=case.apply_router_weight_on_input)


def config_from_call(call: ExpertCall) -> "MoEConfig":
    """The MoEConfig of an ExpertCall's tensors (device kind, dtype, sizes, features)."""
    x = call.hidden_states
    lora = call.w13_lora_a is not None
    return MoEConfig(
        device=x.device.type, dtype=x.dtype, activation=call.activation, H=int(x.shape[1]), I=int(call.w2.shape[2]),
        E=int(call.w13.shape[0]), top_k=int(call.topk_ids.shape[1]), has_bias=call.w13_bias is not None,
        quant=call.quant, lora_enabled=lora, max_lora_rank=int(call.w2_lora_a[0].shape[2]) if lora else 0,
        expert_map=call.expert_map is not None or call.ep_comm is not None,
        apply_router_weight_on_input=call.apply_router_weight_on_input,
        fully_sharded=bool(call.fully_sharded) and lora and call.ep_comm is None)


def context_from_call(call: ExpertCall, config: "MoEConfig") -> "MoELoRAContext | None":
    """The explicit LoRA context of an ExpertCall (None without LoRA). With an expert_map the mapping is also
    the local one; under dispatched EP the factors are sliced to this rank's experts and the prepare sets
    the local mapping from the dispatched one."""
    if call.w13_lora_a is None:
        return None
    a13, b13, a2, b2 = call.w13_lora_a, call.w13_lora_b, call.w2_lora_a, call.w2_lora_b
    if call.ep_comm is not None:
        a13, b13, a2, b2 = slice_lora_to_local(a13, b13, a2, b2, ep_rank=call.ep_rank, ep_size=call.ep_size,
                                               num_experts_global=call.num_experts_global)
    ws = [*a13, *b13, *a2, *b2]
    return MoELoRAContext(
        w13_lora_a_stacked=list(a13), w13_lora_b_stacked=list(b13),
        w2_lora_a_stacked=list(a2), w2_lora_b_stacked=list(b2),
        adapter_enabled=call.adapter_enabled, max_loras=call.max_loras, top_k=config.top_k,
        w13_num_slices=len(call.w13_lora_a), local_num_experts=config.E,
        token_lora_mapping=call.token_lora_mapping,
        local_token_lora_mapping=call.token_lora_mapping if call.expert_map is not None else None,
        enable_moe_shared_loras=any(int(w.shape[1]) == 1 for w in ws) and config.E > 1,
        fully_sharded=config.fully_sharded, tp_rank=call.tp_rank, tp_size=call.tp_size,
        lora_collective=call.lora_collective)


def prepare_finalize_for(call: ExpertCall):
    """(prepare/finalize, expert_map) for a call: the naive EP one over call.ep_comm under dispatched EP
    (it refuses fully-sharded LoRA and an uneven expert split), else the no-EP one with the call's map."""
    if call.ep_comm is None:
        return NoEPPrepareAndFinalize(), call.expert_map
    pf = NaiveEPPrepareAndFinalize(call.ep_comm, call.num_experts_global, fully_sharded=bool(call.fully_sharded))
    return pf, pf.expert_map.to(call.hidden_states.device)


def apply_experts(call: ExpertCall, experts, lora_ctx: "MoELoRAContext | None", pf_and_map=None) -> None:
    """Run an experts object on an ExpertCall through FusedMoEKernel, writing call.output; quantized weights
    are packed for it first. `pf_and_map`: from prepare_finalize_for(call) (built here when not given)."""
    pf, expert_map = pf_and_map or prepare_finalize_for(call)
    w13, w2 = call.w13, call.w2
    if call.quant != "none":
        w13 = pack_weights(call.w13_q, call.w13_scales, call.quant)
        w2 = pack_weights(call.w2_q, call.w2_scales, call.quant)
    FusedMoEKernel(pf, experts).apply(
        call.hidden_states, w13, w2, call.topk_weights, call.topk_ids, lora_ctx=lora_ctx,
        expert_map=expert_map, w13_bias=call.w13_bias, w2_bias=call.w2_bias, output=call.output)


def run_call(call: ExpertCall, experts_cls=None) -> None:
    """Run one ExpertCall on a new experts_cls (default: the oracle's pick) for the call's configuration
    (the layer's construction checks, e.g. EP's, come first, as a layer would make them)."""
    pf_and_map = prepare_finalize_for(call)
    config = config_from_call(call)
    cls = experts_cls or oracle.select_experts(config)
    apply_experts(call, cls(config), context_from_call(call, config), pf_and_map)


def _safe(pred):
    def holds(case):
        try:
            return bool(pred(case))
        except (ValueError, TypeError):
            return False
    return holds


def _claims(cls, case: Case) -> bool:
    """is_supported_config on some device where the declared dtypes hold the case's dtype."""
    return any(cls.is_supported_config(config_from_case(case, dev))[0]
               for dev in sorted(cls.devices) if case.dtype in cls.dtypes.get(dev, ()))


def precision_for(cls):
    """case -> the reference precision preset of the LoRA op path `cls` takes for that case."""
    def precision(case: Case) -> str:
        if not case.lora:
            return "one_shot"
        return cls.lora_path(config_from_case(case), case.T, case.max_loras)
    return precision


# the classes that take no FP8 scheme say why (harness.spec.contract's `reasons`)
FP8_DECLINE = ("FP8 runs in the fused-MoE Triton experts (triton_experts and its subclasses); this kernel takes no "
               "e4m3 operands")
FP8_REASONS = {("quant", q): FP8_DECLINE for q in FP8_QUANTS}


def capabilities_of(cls) -> Capabilities:
    """Capabilities translated from the class's declarations, plus the is_supported_config rule."""
    rules = tuple(Rule(r.name, _safe(lambda c, r=r: r.holds(config_from_case(c))), r.reason)
                  for r in cls.shape_rules)
    rules += (Rule(f"{cls.name}.is_supported_config", _safe(lambda c: _claims(cls, c)),
                   "declined by the class's is_supported_config (kernels.experts.oracle.explain says why)"),)
    return Capabilities(
        levels=frozenset({"expert"}), devices=frozenset(cls.devices), dtypes=dict(cls.dtypes),
        dtype_reasons=dict(cls.dtype_reasons), activations=frozenset(cls.activations),
        non_gated=cls.supports_non_gated, bias=cls.supports_bias, lora=cls.supports_lora(), base_only=True,
        quant=frozenset(cls.quant_schemes), expert_map=cls.supports_ep, fully_sharded=cls.supports_fully_sharded,
        max_rank=cls.max_lora_rank, shared_lora=True, tensor_parallel=True, expert_parallel=cls.supports_ep,
        rules=rules, reasons={k: v for k, v in FP8_REASONS.items() if k[1] not in cls.quant_schemes})


def spec_for(cls, description: str) -> BackendSpec:
    """A harness BackendSpec for an experts class: capabilities from its declarations, run through FusedMoEKernel."""
    return BackendSpec(
        name=cls.name, description=description, capabilities=capabilities_of(cls),
        experts=lambda call: run_call(call, cls), precision=precision_for(cls), model_points_only=TRITON_POINTS_ONLY,
        fp8_mma=TRITON_FP8_MMA if cls.quant_schemes & set(FP8_QUANTS) else None)


def _oracle_spec() -> BackendSpec:
    classes = oracle.BACKEND_PRIORITY
    devices = frozenset().union(*(c.devices for c in classes))
    dtypes = {d: frozenset().union(*(c.dtypes.get(d, frozenset()) for c in classes)) for d in devices}
    reasons = {}
    for c in classes:
        for key, why in c.dtype_reasons.items():
            if key[1] not in dtypes.get(key[0], ()):
                reasons.setdefault(key, why)

    def picked(case):
        return oracle.select_experts(config_from_case(case))

    rule = Rule("select_experts", _safe(lambda c: any(_claims(cls, c) for cls in classes)),
                "no backend in BACKEND_PRIORITY supports it (kernels.experts.oracle.explain lists why)")
    on_cpu = Rule("selection at stake", _safe(_selection_at_stake_on_cpu),
                  "adds nothing on the CPU: the oracle picks TritonExperts for a gated activation, and "
                  "triton_experts' own row runs this very case; what the oracle adds, the selection, "
                  "suites/experts/test_oracle.py checks (on a GPU every case still runs)", devices=frozenset({"cpu"}))
    return BackendSpec(
        name="experts_oracle",
        description="runs whatever kernels.experts.oracle.select_experts picks (priority: "
                    + ", ".join(c.name for c in classes) + ")",
        capabilities=Capabilities(levels=frozenset({"expert"}), devices=devices, dtypes=dtypes,
                                  dtype_reasons=reasons, quant=frozenset().union(*(c.quant_schemes for c in classes)),
                                  tensor_parallel=True, expert_parallel=True, rules=(rule, on_cpu)),
        experts=run_call,
        precision=lambda case: _oracle_precision(case, picked), model_points_only=TRITON_POINTS_ONLY,
        fp8_mma=TRITON_FP8_MMA)


def _selection_at_stake_on_cpu(case: Case) -> bool:
    """Whether the oracle's run of `case` on the CPU checks more than its pick's own row of it: the pick
    declines the case (a selection bug), or the selection is one of its decisions: a class other than the
    general TritonExperts (the fast path at I % 128 == 0, OAI for swigluoai, Marlin for quantized weights), or
    a non-gated activation (passing over the gated-only classes, where vLLM's LoRA early return did not)."""
    from moe_lora_harness.kernels.experts.triton_experts import TritonExperts
    from moe_lora_harness.reference.activations import is_gated
    config = config_from_case(case, "cpu")
    cls = oracle.select_experts(config)
    declines = not (case.dtype in cls.dtypes.get("cpu", ()) and cls.is_supported_config(config)[0])
    return declines or cls is not TritonExperts or not is_gated(case.activation)


def _oracle_precision(case: Case, picked) -> str:
    if not case.lora:
        return "one_shot"
    try:
        return precision_for(picked(case))(case)
    except oracle.NoBackendError:   # probing a case no backend claims: any preset; the run itself fails
        return "one_shot"


def unavailable(name: str, why: str = _IMPORT_ERROR) -> BackendSpec:
    """An expert backend whose kernels did not import: it claims nothing, and every case says `why`."""
    return BackendSpec(name=name, description=f"{name} (unavailable)",
                       capabilities=Capabilities(levels=frozenset({"expert"}), devices=frozenset(),
                                                 rules=(Rule("import", lambda c: False, why),)),
                       experts=lambda call: None)


if oracle is not None:
    from moe_lora_harness.kernels.experts.gated_fast_experts import GatedFastExperts
    from moe_lora_harness.kernels.experts.marlin_experts import MarlinExperts
    from moe_lora_harness.kernels.experts.oai_experts import OAIExperts
    from moe_lora_harness.kernels.experts.triton_experts import TritonExperts

    TRITON_EXPERTS = spec_for(TritonExperts, "Triton fused-MoE experts + LoRA mixin (every activation, bias, EP)")
    GATED_FAST_EXPERTS = spec_for(GatedFastExperts, "gated-SiLU fast path (fused silu-and-mul; I % 128 == 0; 16-bit)")
    OAI_EXPERTS = spec_for(OAIExperts, "gather/scatter grouped-GEMM experts, swigluoai, LoRA in the permuted layout")
    MARLIN_EXPERTS = spec_for(MarlinExperts, "weight-only int4 g128 / int8 per-channel experts, dequant in the GEMM, "
                                          "LoRA through the wrapper's closures")
    EXPERTS_ORACLE = _oracle_spec()
else:
    TRITON_EXPERTS = unavailable("triton_experts")
    GATED_FAST_EXPERTS = unavailable("gated_fast_experts")
    OAI_EXPERTS = unavailable("oai_experts")
    MARLIN_EXPERTS = unavailable("marlin_experts")
    EXPERTS_ORACLE = unavailable("experts_oracle")

ALL = [TRITON_EXPERTS, GATED_FAST_EXPERTS, OAI_EXPERTS, MARLIN_EXPERTS, EXPERTS_ORACLE]
