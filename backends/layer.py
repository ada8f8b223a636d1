"""Layer-level backends: our StatefulMoELoRALayer (kernels/layer) behind the harness's layer contract
(harness.spec.layer_contract), one BackendSpec per experts class it runs.

`ContractLayer` is the adapter: it loads a checkpoint-layout ExpertAdapter the way vLLM's set_lora does (cast
to the layer dtype, then `B *= scaling` in that dtype; non-gated layers keep the gate factors only), pads to
the layer's padded intermediate size, and hands batches to the layer. Capabilities are the experts class's
own (backends.experts.capabilities_of) at the layer level; rules accept an expert-level Case or a LayerConfig.
"""
from __future__ import annotations

import dataclasses

import torch

from moe_lora_harness.backends.experts import capabilities_of, precision_for, unavailable
from moe_lora_harness.backends.rounding import TRITON_POINTS_ONLY
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.contract import BackendSpec, Rule
from moe_lora_harness.harness.spec.layer_contract import LayerBatch, LayerConfig, LayerWeights
from moe_lora_harness.harness.layer.layer_judge import layer_case
from moe_lora_harness.reference import activations as ref_act
from moe_lora_harness.reference.adapters import ExpertAdapter

try:
    import triton  # noqa: F401
    from moe_lora_harness.backends.dual_stream import dual_stream_precision
    from moe_lora_harness.kernels import eager_experts as kernel_act
    from moe_lora_harness.kernels.experts.config import MoEConfig
    from moe_lora_harness.kernels.layer.stateful import StatefulMoELoRALayer
    from moe_lora_harness.kernels.triton.quant_gemm import pack_weights
    _LAYER_ERROR = ""
except Exception as e:  # noqa: BLE001 - declared, not hidden: every case reports this reason
    StatefulMoELoRALayer = None
    _LAYER_ERROR = f"layer kernels not importable: {type(e).__name__}: {e}"


# ----------------------------------------------------------------------------- configuration


def _constants(config) -> list:
    """(field, asked, what our kernels compute) for each activation constant the config's activation reads."""
    act = getattr(config, "activation", "silu")
    if act in ("swigluoai", "swigluoai_uninterleave"):
        pairs = [("swiglu_alpha", kernel_act.OAI_ALPHA), ("swiglu_limit", kernel_act.OAI_LIMIT)]
        if act == "swigluoai_uninterleave":
            pairs.append(("swiglu_beta", 1.0))
    elif act == "situ":
        pairs = [("situ_beta", kernel_act.SITU_BETA), ("situ_linear_beta", kernel_act.SITU_LINEAR_BETA)]
    else:
        pairs = []
    return [(f, getattr(config, f), v) for f, v in pairs if hasattr(config, f)]


def constant_mismatch(config) -> str:
    """Why our kernels cannot compute the config's activation constants ('' when they can)."""
    bad = [f"{f}={a} (the kernels compute {v})" for f, a, v in _constants(config) if float(a) != float(v)]
    return ", ".join(bad)


def padded_I(config: LayerConfig) -> int:
    """The intermediate size the layer holds: config.intermediate_padded, or I."""
    p = config.intermediate_padded or config.I
    if p < config.I:
        raise ValueError(f"intermediate_padded={config.intermediate_padded} must be 0 or >= I={config.I}")
    return p


def moe_config(config: LayerConfig) -> "MoEConfig":
    """The kernels' MoEConfig of a layer (its padded intermediate size; LoRA rank 0 when disabled)."""
    return MoEConfig(device=torch.device(config.device).type, dtype=config.torch_dtype, activation=config.activation,
                     H=config.H, I=padded_I(config), E=config.E, top_k=config.top_k, has_bias=config.bias,
                     quant=config.quant, lora_enabled=config.lora_enabled,
                     max_lora_rank=config.max_rank if config.lora_enabled else 0)


def as_case(obj) -> Case:
    """An expert-level Case for a LayerConfig (what the experts class's declarations are asked about)."""
    if not isinstance(obj, LayerConfig):
        return obj
    return layer_case(obj, obj.max_tokens).replace(I=obj.intermediate_padded or obj.I)


def _pad_rows(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`t` zero-padded along `dim` to `size`."""
    if t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size - shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def pad_base(config: LayerConfig, w: LayerWeights) -> LayerWeights:
    """Base weights padded with zeros to the padded intermediate size (gate and up halves each; swigluoai's
    interleaved pairs at the end); padded columns compute act(0) = 0 and add nothing."""
    Ip = padded_I(config)
    if Ip == config.I:
        return w
    act = ref_act.lookup_activation(config.activation)

    def w13_like(t, dim):
        if not act.gated or act.interleaved:
            return _pad_rows(t, dim, Ip * (2 if act.gated else 1))
        g, u = t.chunk(2, dim=dim)
        return torch.cat([_pad_rows(g, dim, Ip), _pad_rows(u, dim, Ip)], dim=dim)

    return LayerWeights(w13_like(w.w13, 1), _pad_rows(w.w2, 2, Ip),
                        None if w.w13_bias is None else w13_like(w.w13_bias, 1), w.w2_bias)


def base_tensors(config: LayerConfig, w: LayerWeights):
    """(w13, w2) the layer runs: the weights, or QuantWeights packed from their grid (quantized configs: the
    harness gives weights already on the scheme's grid, so quantizing them again loses nothing)."""
    if config.quant == "none":
        return w.w13, w.w2
    from moe_lora_harness.reference.quant import quantize
    return tuple(pack_weights(*quantize(t, config.quant, config.torch_dtype), config.quant) for t in (w.w13, w.w2))


# ----------------------------------------------------------------------------- the contract adapter


class ContractLayer:
    """A StatefulMoELoRALayer behind harness.spec.layer_contract's methods."""

    def __init__(self, layer: "StatefulMoELoRALayer", config: LayerConfig):
        self.layer, self.config = layer, config

    def load_adapter(self, slot: int, adapter: ExpertAdapter) -> None:
        """Cast every factor to the layer dtype, fold each module's scaling into its B in that dtype (vLLM's
        order; w13: `scaling`, w2: `w2_scaling`), pad to the padded intermediate size and each module's rank to
        the adapter's largest (zeros add nothing), and set the slot (non-gated: the gate factors only)."""
        c, dt, dev = self.config, self.config.torch_dtype, self.layer.device
        if not isinstance(adapter, ExpertAdapter):
            raise TypeError(f"adapter must be a reference.adapters.ExpertAdapter; got {type(adapter).__name__}")
        gated = ref_act.is_gated(c.activation)
        if gated and not adapter.gated:
            raise ValueError("a gated layer needs the adapter's up_proj (w3) factors; up_a/up_b are None")
        Ip, r = self.layer.config.I, adapter.rank

        def a(t, pad_in=False):
            t = _pad_rows(t.to(dt), 1, r)
            return (_pad_rows(t, 2, Ip) if pad_in else t).to(dev)

        def b(t, scaling, pad_out=False):
            t = t.to(dt).clone()
            t.mul_(float(scaling))                  # rounded once in dt, as `lora_b *= scaling`
            t = _pad_rows(t, 2, r)
            return (_pad_rows(t, 1, Ip) if pad_out else t).to(dev)

        pairs = [(adapter.gate_a, adapter.gate_b)] + ([(adapter.up_a, adapter.up_b)] if gated else [])
        self.layer.set_lora(slot, [a(x) for x, _ in pairs], [b(y, adapter.scaling, pad_out=True) for _, y in pairs],
                            a(adapter.down_a, pad_in=True), b(adapter.down_b, adapter.w2_scaling))

    def unload_adapter(self, slot: int) -> None:
        """The slot holds nothing afterwards (zeroed and disabled)."""
        self.layer.reset_lora(slot)

    def set_mapping(self, mapping: torch.Tensor) -> None:
        """Each token's slot or -1, for the next forward or replay."""
        self.layer.set_mapping(mapping)

    def forward(self, batch: LayerBatch) -> torch.Tensor:
        """(T, H): an eager forward (the layer routes by the batch's top-k choice)."""
        return self.layer.forward(batch.hidden_states, batch.topk_weights, batch.topk_ids)

    def capture(self, size: int) -> None:
        """Record a forward of `size` tokens (a CUDA graph on a GPU)."""
        self.layer.capture(size)

    def replay(self, batch: LayerBatch) -> torch.Tensor:
        """(S, H): the graph of the batch's size, padding rows mapped to -1."""
        return self.layer.replay(batch.hidden_states, batch.topk_weights, batch.topk_ids)


def make_factory(experts_cls, layer_cls=None):
    """(LayerConfig, LayerWeights) -> ContractLayer over `layer_cls` (default StatefulMoELoRALayer) running
    `experts_cls`; a configuration the class declines, or activation constants our kernels do not compute,
    raise ValueError with the reason."""
    def factory(config: LayerConfig, weights: LayerWeights) -> ContractLayer:
        if not isinstance(config, LayerConfig) or not isinstance(weights, LayerWeights):
            raise TypeError("a layer factory takes (LayerConfig, LayerWeights)")
        why = constant_mismatch(config)
        if why:
            raise ValueError(f"activation {config.activation}: {why}")
        mc = moe_config(config)
        ok, reason = experts_cls.is_supported_config(mc)
        if not ok:
            raise ValueError(f"{experts_cls.name} declines this layer: {reason}")
        w = pad_base(config, weights)
        w13, w2 = base_tensors(config, w)
        layer = (layer_cls or StatefulMoELoRALayer)(
            experts_cls, mc, w13, w2, w13_bias=w.w13_bias, w2_bias=w.w2_bias, max_loras=config.max_loras,
            max_tokens=config.max_tokens, device=torch.device(config.device))
        return ContractLayer(layer, config)
    return factory


# ----------------------------------------------------------------------------- specs


def _rule(rule: Rule) -> Rule:
    """An expert-level rule that also takes a LayerConfig."""
    return dataclasses.replace(rule, holds=lambda c, h=rule.holds: h(as_case(c)))


CONSTANTS_RULE = Rule("activation constants", lambda c: not constant_mismatch(c),
                      "our kernels compute swigluoai / situ with fixed constants (kernels.eager_experts)")


def layer_capabilities(experts_cls, graphs: bool = True):
    """The experts class's declarations at the layer level: one unsharded rank, graphs, any max_tokens."""
    cap = capabilities_of(experts_cls)
    return dataclasses.replace(
        cap, levels=frozenset({"layer"}), tensor_parallel=False, expert_parallel=False, expert_map=False,
        fully_sharded=False, shared_lora=False, rules=tuple(_rule(r) for r in cap.rules) + (CONSTANTS_RULE,),
        graphs=graphs, max_tokens=None, slot_reuse=True)


def layer_spec(name: str, experts_cls, description: str, *, layer_cls=None, precision=None, graphs: bool = True,
               origin: str = "", cpu_rows_in_full_tier: str = "") -> BackendSpec:
    """A layer-level BackendSpec: `experts_cls` in `layer_cls` (default StatefulMoELoRALayer)."""
    return BackendSpec(name=name, description=description, capabilities=layer_capabilities(experts_cls, graphs),
                       layer=make_factory(experts_cls, layer_cls),
                       precision=precision or (lambda case, p=precision_for(experts_cls): p(as_case(case))),
                       origin=origin, cpu_rows_in_full_tier=cpu_rows_in_full_tier, model_points_only=TRITON_POINTS_ONLY)


# the built-in layers other than layer_triton: StatefulMoELoRALayer's state handling over other experts
_SHARED_STATE = ("layer_triton's state handling (StatefulMoELoRALayer) over other experts, whose own rows run at the "
                 "expert level")


def _unavailable_layer(name: str) -> BackendSpec:
    spec = unavailable(name, _LAYER_ERROR)
    return dataclasses.replace(spec, capabilities=dataclasses.replace(spec.capabilities, levels=frozenset({"layer"})),
                               experts=None, layer=lambda config, weights: None)


if StatefulMoELoRALayer is not None:
    from moe_lora_harness.kernels.experts.dual_stream_experts import DualStreamTritonExperts
    from moe_lora_harness.kernels.experts.marlin_experts import MarlinExperts
    from moe_lora_harness.kernels.experts.oai_experts import OAIExperts
    from moe_lora_harness.kernels.experts.triton_experts import TritonExperts

    LAYER_TRITON = layer_spec("layer_triton", TritonExperts,
                              "stateful MoE+LoRA layer (static buffers, slots, graphs) over TritonExperts")
    LAYER_DUAL_STREAM = layer_spec("layer_dual_stream", DualStreamTritonExperts,
                                   "stateful layer over DualStreamTritonExperts (LoRA deltas on the layer's aux "
                                   "stream, inside the captured graph)",
                                   precision=lambda case: dual_stream_precision(as_case(case)),
                                   cpu_rows_in_full_tier=_SHARED_STATE)
    LAYER_MARLIN = layer_spec("layer_marlin", MarlinExperts,
                              "stateful layer over MarlinExperts (weights quantized onto the scheme's grid at "
                              "construction)", cpu_rows_in_full_tier=_SHARED_STATE)
    LAYER_OAI = layer_spec("layer_oai", OAIExperts,
                           "stateful layer over OAIExperts (swigluoai); no graphs: permute_pairs reads the pair "
                           "count on the host", graphs=False, cpu_rows_in_full_tier=_SHARED_STATE)
else:
    LAYER_TRITON, LAYER_DUAL_STREAM, LAYER_MARLIN, LAYER_OAI = (
        _unavailable_layer(n) for n in ("layer_triton", "layer_dual_stream", "layer_marlin", "layer_oai"))

LAYERS = [LAYER_TRITON, LAYER_DUAL_STREAM, LAYER_MARLIN, LAYER_OAI]
