"""Expert-level backend `triton_experts_dual_stream`: TritonExperts with the LoRA deltas on an aux stream.

Same declarations as TritonExperts (the class inherits them), checked by its own is_supported_config.
Rounding model: the dual-stream add, rnd(cache + rnd(delta)), over the LoRA op path the class takes
("dual_stream", or "dual_stream_small_batch" when the delta comes from the small-batch kernel); with a
fully-sharded LoRA, or a batch above the context's dual_stream_max_tokens (default 128), the class runs on
one stream and follows that path's own preset. One experts object
per configuration is kept, so the aux stream and events are created once, as a layer would.
On the CPU every call also runs the Recorder's race check (a race raises, failing the case).
"""
from __future__ import annotations

from moe_lora_harness.harness.case import Case
from moe_lora_harness.harness.contract import BackendSpec, Capabilities, Rule

try:
    import triton  # noqa: F401
    from moe_lora_harness.backends.experts import config_from_call, config_from_case, context_from_call
    from moe_lora_harness.kernels.experts.dual_stream_experts import DualStreamTritonExperts
    from moe_lora_harness.kernels.experts.modular import FusedMoEKernel
    from moe_lora_harness.kernels.experts.prepare_finalize import NoEPPrepareAndFinalize
    _IMPORT_ERROR = ""
except Exception as e:  # noqa: BLE001 - declared, not hidden: every case reports this reason
    DualStreamTritonExperts = None
    _IMPORT_ERROR = f"dual-stream experts not importable: {type(e).__name__}: {e}"

_LAYERS: dict = {}   # MoEConfig -> DualStreamTritonExperts (one "layer" per configuration)


def dual_stream_precision(case: Case) -> str:
    """Reference preset: the dual-stream add over the LoRA op path the experts take for this case."""
    if not case.lora:
        return "one_shot"
    path = DualStreamTritonExperts.lora_path(config_from_case(case), case.T, case.max_loras)
    if not DualStreamTritonExperts.dual_stream_applies(case.fully_sharded, case.T):
        return path                        # one stream: the path's own rounding
    return "dual_stream_small_batch" if path == "small_batch" else "dual_stream"


def run_experts(call) -> None:
    """ExpertCall -> FusedMoEKernel(no-EP prepare/finalize, this config's dual-stream experts), dual_stream on."""
    config = config_from_call(call)
    experts = _LAYERS.get(config)
    if experts is None:
        experts = _LAYERS[config] = DualStreamTritonExperts(config)
    ctx = context_from_call(call, config)
    if ctx is not None:
        ctx.dual_stream = True
    FusedMoEKernel(NoEPPrepareAndFinalize(), experts).apply(
        call.hidden_states, call.w13, call.w2, call.topk_weights, call.topk_ids, lora_ctx=ctx,
        expert_map=call.expert_map, w13_bias=call.w13_bias, w2_bias=call.w2_bias, output=call.output)


def _claims(case: Case) -> bool:
    cls = DualStreamTritonExperts
    try:
        return any(cls.is_supported_config(config_from_case(case, dev))[0]
                   for dev in sorted(cls.devices) if case.dtype in cls.dtypes.get(dev, ()))
    except (ValueError, TypeError):
        return False


def _capabilities() -> Capabilities:
    if DualStreamTritonExperts is None:
        return Capabilities(levels=frozenset({"expert"}), devices=frozenset(),
                            rules=(Rule("import", lambda c: False, _IMPORT_ERROR),))
    cls = DualStreamTritonExperts
    return Capabilities(
        levels=frozenset({"expert"}), devices=frozenset(cls.devices), dtypes=dict(cls.dtypes),
        dtype_reasons=dict(cls.dtype_reasons), activations=frozenset(cls.activations),
        non_gated=cls.supports_non_gated, bias=cls.supports_bias, lora=True, base_only=True,
        quant=frozenset(cls.quant_schemes), expert_map=cls.supports_ep, fully_sharded=cls.supports_fully_sharded,
        max_rank=cls.max_lora_rank, shared_lora=True, tensor_parallel=True,
        rules=(Rule(f"{cls.name}.is_supported_config", _claims,
                    "declined by the class's is_supported_config (kernels.experts.oracle.explain says why)"),))


BACKEND = BackendSpec(
    name="triton_experts_dual_stream",
    description="Triton experts with LoRA deltas on an aux stream (add_inputs=False into zeroed buffers, "
                "joined by events, added on main; spec 5 dual-stream mode)",
    capabilities=_capabilities(),
    experts=run_experts if DualStreamTritonExperts is not None else (lambda call: None),
    precision=dual_stream_precision,
)
