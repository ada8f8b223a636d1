"""moe-lora-harness: a conformance harness for Mixture-of-Experts + LoRA kernels (vLLM 0.33.0 semantics).

The public surface, for a third party declaring a backend, is what this module exports (`__all__`):

    from moe_lora_harness import BackendSpec, Capabilities, Case, ExpertCall, KnownBug, Rule
    from moe_lora_harness import ExpertAdapter, LayerBatch, LayerConfig, LayerWeights   # a stateful layer

Subpackages (one import name each): `moe_lora_harness.op_contract` (vLLM's op signature and argument
checks), `moe_lora_harness.reference` (the float64 truth), `moe_lora_harness.kernels` (our kernels),
`moe_lora_harness.harness` (cases, contract, runner, CLI), `moe_lora_harness.backends` (our backends'
declarations), `moe_lora_harness.suites` (the pytest suites).
In the repository they are the top-level folders; `src/moe_lora_harness/` links them into this package,
so an editable install is one static path entry (docs/architecture.md, "Layout").
"""
from __future__ import annotations

from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.contract import BackendSpec, Capabilities, ExpertCall, KnownBug, Rule
from moe_lora_harness.harness.spec.layer_contract import LayerBatch, LayerConfig, LayerWeights
from moe_lora_harness.reference.adapters import ExpertAdapter

__version__ = "0.2.0"

__all__ = ["BackendSpec", "Capabilities", "Case", "ExpertAdapter", "ExpertCall", "KnownBug", "LayerBatch", "LayerConfig",
           "LayerWeights", "Rule", "__version__"]
