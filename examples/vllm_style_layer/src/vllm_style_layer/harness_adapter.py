"""The wrapper that makes the stranger's layer (layer.py) a layer-level moe-lora-harness backend.

The harness drives a layer through four methods (harness/spec/layer_contract.py); each is one call into the
engine-facing API the layer already has, exactly as vLLM's LoRA manager and model runner make them:

    load_adapter(slot, adapter)  -> cast to the layer dtype, fold each module's scaling into its B, set_lora
    unload_adapter(slot)         -> reset_lora(slot)
    set_mapping(mapping)         -> update_mapping(mapping)          (punica's per-batch metadata)
    forward(batch)               -> forward(hidden_states, router_logits)   (the layer routes itself)

No graph capture (Capabilities.graphs=False): this layer is eager PyTorch.
"""
from __future__ import annotations

import torch

from moe_lora_harness import BackendSpec, Capabilities, ExpertAdapter, LayerBatch, LayerConfig, LayerWeights

from vllm_style_layer.layer import ACTIVATIONS, MoELoRALayer


class HarnessLayer:
    """One MoELoRALayer behind the harness's layer methods; `config.lora_enabled=False` builds the twin
    (no LoRA buffers, never given an adapter or a mapping)."""

    def __init__(self, config: LayerConfig, weights: LayerWeights):
        """Build the layer from the harness's base weights and, unless it is the twin, its LoRA buffers."""
        if config.quant != "none":
            raise ValueError(f"quant {config.quant!r} is not supported (unquantized weights only)")
        self.config = config
        self.dtype = config.torch_dtype
        self.layer = MoELoRALayer(weights.w13, weights.w2, top_k=config.top_k, renormalize=config.renormalize,
                                  activation=config.activation, w13_bias=weights.w13_bias,
                                  w2_bias=weights.w2_bias)
        if config.lora_enabled:
            self.layer.create_lora_weights(config.max_loras, config.max_rank, self.dtype)

    def load_adapter(self, slot: int, adapter: ExpertAdapter) -> None:
        """As vLLM's LoRA manager: every factor cast to the layer dtype, then `b *= scaling` in that dtype
        (one rounding; w13 `scaling`, w2 `w2_scaling`), each module's rank zero-padded to the adapter's largest
        (set_lora takes one rank), the lists built in vLLM's [w1, w2, w3] order and handed to set_lora."""
        dev, r = self.layer.device, adapter.rank

        def pad_rank(t, dim):
            extra = r - t.shape[dim]
            if extra == 0:
                return t
            shape = list(t.shape)
            shape[dim] = extra
            return torch.cat([t, t.new_zeros(shape)], dim=dim)

        def a(t):
            return None if t is None else pad_rank(t.to(device=dev, dtype=self.dtype), 1)

        def b(t, scaling):
            if t is None:
                return None
            t = t.to(device=dev, dtype=self.dtype).clone()    # clone: .to() may return the caller's tensor
            t *= scaling
            return pad_rank(t, 2)

        up_a, up_b = (adapter.up_a, adapter.up_b) if self.layer.gated else (None, None)  # non-gated: no w3
        lora_a = [a(adapter.gate_a), a(adapter.down_a), a(up_a)]
        lora_b = [b(adapter.gate_b, adapter.scaling), b(adapter.down_b, adapter.w2_scaling), b(up_b, adapter.scaling)]
        self.layer.set_lora(slot, lora_a, lora_b)

    def unload_adapter(self, slot: int) -> None:
        """The slot holds nothing: zeroed and disabled."""
        self.layer.reset_lora(slot)

    def set_mapping(self, mapping: torch.Tensor) -> None:
        """(T,) int32 token -> slot (-1: no adapter) for the next forward."""
        self.layer.update_mapping(mapping)

    def forward(self, batch: LayerBatch) -> torch.Tensor:
        """(T, H): the layer routes itself from the logits; batch.topk_* are what the harness routed to
        judge it and must agree (same softmax top-k)."""
        return self.layer.forward(batch.hidden_states, batch.router_logits)


def make_layer(config: LayerConfig, weights: LayerWeights) -> HarnessLayer:
    """BackendSpec.layer: the factory the harness builds the layer (and, with lora_enabled False, its twin) with."""
    return HarnessLayer(config, weights)


SPEC = BackendSpec(
    name="vllm_style_layer",
    description="example stateful layer: a pure-PyTorch MoE+LoRA layer driven like vLLM's FusedMoEWithLoRA "
                "(create_lora_weights / set_lora / reset_lora / mapping update / forward that routes itself)",
    capabilities=Capabilities(
        levels=frozenset({"layer"}),
        devices=frozenset({"cpu", "cuda"}),
        activations=frozenset(ACTIVATIONS),     # silu, gelu, gelu_tanh and their *_no_mul forms, relu2_no_mul
        non_gated=True,
        bias=True,
        quant=frozenset({"none"}),
        # features this layer does not have (op / expert-level axes), declared so they are never claimed
        fully_sharded=False,
        expert_map=False,
        shared_lora=False,
        graphs=False,
        max_tokens=None,
        slot_reuse=True,                         # set_lora resets the slot before copying
    ),
    layer=make_layer,
    # Where the layer rounds: the rank intermediate u = rnd(A x), the delta rnd(w? B u) and the add into the
    # cache each once, every GEMM in fp32. That is the `one_shot` preset (`two_kernel` has the same rounding
    # points; it names vLLM's fully-sharded / rank > 128 path, which this unsharded layer does not model).
    # Not `small_batch`: that path keeps u and the delta in fp32 and rounds only the add.
    precision="one_shot",
)
