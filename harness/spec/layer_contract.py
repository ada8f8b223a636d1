"""The layer level of the backend contract: a stateful MoE+LoRA layer, built once and driven across calls.

A serving engine builds its MoE layer once for a configuration (vLLM's FusedMoEWithLoRA) and then, batch
after batch, loads and unloads adapters, sets the token -> slot mapping and runs forwards, some of them
captured once as a CUDA graph and replayed later at a padded size. `BackendSpec.layer(config, weights)`
builds such a layer; the harness drives it through these methods (docs/architecture.md, "The layer level"):

  load_adapter(slot, adapter)  `adapter`: reference.adapters.ExpertAdapter (checkpoint layout: per-expert A
                               (E, r, in), B (E, out, r), float32, unscaled; w13 (gate, up) and w2 (down)
                               may differ in rank, and each module has its scaling: `scaling` for w13,
                               `w2_scaling` for w2). The layer casts every factor to its dtype and folds
                               each module's scaling into its B in that dtype (vLLM: `lora_b *= scaling`
                               after the cast); each module's rank r satisfies 1 <= r <= max_rank, the
                               rest of the slot's rank is zero. A used slot is replaced (any rank).
  unload_adapter(slot)         the slot holds nothing: tokens mapped to it get no adapter.
  set_mapping(mapping)         (T,) int32 on the layer's device, each token's slot or -1 (no adapter); it
                               holds for the next forward or replay.
  forward(batch) -> (T, H)     `batch`: LayerBatch of the T tokens of the last mapping.
  capture(size)                (Capabilities.graphs) record a forward of `size` tokens (a CUDA graph on a GPU).
  replay(batch) -> (S, H)      `batch` holds S = a captured size tokens; the mapping covers its first
                               T <= S; the other rows are padding. Their values are free (an engine discards
                               them; vLLM 0.33 does not pad the mapping: its padding rows read the previous
                               batch's slots, or whatever the buffer held), but they must not change a real row.
                               The first T rows are judged.

The twin is the same factory with `lora_enabled=False, base_twin=True`, driven the same way but never given an
adapter or a mapping: a token without an adapter must come out of the layer bit for bit as out of the twin (an
engine that would select other experts without LoRA must build the twin on the LoRA layer's experts).
Routing: the batch carries the router's logits and its choice; the logits lead at the k-th expert by
`layer_scenario.ROUTING_MARGIN`, so a layer that routes itself chooses the same experts.
What an engine cannot express is declared (harness.spec.contract.Capabilities: maps_unloaded_slots, layer_max_ranks,
layer_lora_dtypes, slot_reuse, graphs, max_tokens) and the scenarios that need it are declined with the reason.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch

from moe_lora_harness.reference.activations import (
    OAI_ALPHA, OAI_LIMIT, SITU_BETA, SITU_LINEAR_BETA, UNINTERLEAVE_BETA,
)

LAYER_METHODS = ("load_adapter", "unload_adapter", "set_mapping", "forward")
LAYER_DTYPES = ("float16", "bfloat16", "float32")
GRAPH_METHODS = ("capture", "replay")


@dataclass(frozen=True)
class LayerConfig:
    """What a layer is built for: sizes, activation (with the constants a real layer reads from its model
    config), dtype, device, LoRA limits, the largest batch, the router, and the sizes it may capture."""

    H: int
    I: int
    E: int
    top_k: int
    activation: str = "silu"
    dtype: str = "float16"
    device: str = "cpu"
    max_loras: int = 2
    max_rank: int = 8
    max_tokens: int = 16
    lora_enabled: bool = True
    bias: bool = False
    quant: str = "none"
    intermediate_padded: int = 0          # the padded per-partition intermediate size a layer may hold (0: I)
    swiglu_alpha: float = OAI_ALPHA        # swigluoai: gate * sigmoid(alpha * gate), clamped at limit
    swiglu_limit: float = OAI_LIMIT
    swiglu_beta: float = UNINTERLEAVE_BETA  # the un-interleaved form's (up + beta)
    situ_beta: float = SITU_BETA
    situ_linear_beta: float = SITU_LINEAR_BETA
    renormalize: bool = True               # router: softmax over E, top-k, renormalized to sum 1
    capture_sizes: tuple = ()              # the padded batch sizes a graph may be captured at
    lora_dtype: str = ""                   # the LoRA factors' dtype ("": the layer's dtype; vLLM's lora_dtype)
    max_num_seqs: int = 0                  # the engine's most sequences per batch (0: max_tokens, every token may
                                           # be its own sequence; vLLM sizes its LoRA metadata by it)
    base_twin: bool = False                # built as a LoRA layer's base twin: build the base path with the experts
                                           # the LoRA-enabled layer uses (an engine that selects another experts
                                           # class without LoRA must pin the LoRA layer's here)

    def __post_init__(self):
        for name in ("dtype", "lora_dtype"):
            v = getattr(self, name)
            if v not in LAYER_DTYPES and not (name == "lora_dtype" and v == ""):
                raise ValueError(f"LayerConfig.{name} must be one of {LAYER_DTYPES}" +
                                 (" or '' (the layer's dtype)" if name == "lora_dtype" else "") + f"; got {v!r}")
        if self.max_num_seqs < 0:
            raise ValueError(f"LayerConfig.max_num_seqs must be >= 0 (0: max_tokens); got {self.max_num_seqs}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The layer's activation dtype."""
        return getattr(torch, self.dtype)

    @property
    def lora_torch_dtype(self) -> torch.dtype:
        """The dtype the layer holds its LoRA factors in."""
        return getattr(torch, self.lora_dtype or self.dtype)

    def twin(self) -> "LayerConfig":
        """The same layer with LoRA disabled, built as the LoRA layer's base twin."""
        return dataclasses.replace(self, lora_enabled=False, base_twin=True)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["capture_sizes"] = list(self.capture_sizes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LayerConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown LayerConfig field(s) {unknown}; known: {sorted(names)}")
        d = dict(d)
        d["capture_sizes"] = tuple(d.get("capture_sizes", ()))
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


@dataclass
class LayerWeights:
    """The base weights a layer is built with, on its device in its dtype: w13 (E, N1, H) with N1 = 2I gated
    (gate rows first) or I; w2 (E, H, I); optional biases (E, N1), (E, H)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None


@dataclass
class LayerBatch:
    """One batch: hidden states (S, H) in the layer's dtype, the router's logits (S, E) float32 and its
    choice, top-k weights (S, k) float32 and ids (S, k) int32 (softmax, top-k, renormalized per the config:
    a layer that routes itself from the logits must get the same). All on the layer's device."""

    hidden_states: torch.Tensor
    router_logits: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.hidden_states.shape[0])


def missing_methods(layer, graphs: bool) -> list:
    """The contract methods `layer` lacks (graph methods only when it claims graphs)."""
    need = LAYER_METHODS + (GRAPH_METHODS if graphs else ())
    return [m for m in need if not callable(getattr(layer, m, None))]
