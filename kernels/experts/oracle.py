"""Backend selection from declarations only: the first experts class in priority order whose
`is_supported_config` accepts the config.

No feature (LoRA included) short-circuits the checks: vLLM 0.33.0's LoRA early return skipped them and
sent a non-gated activation to a gated-only kernel. Every candidate is judged by the same method.
"""
from __future__ import annotations

from moe_lora_harness.kernels.experts.config import MoEConfig
from moe_lora_harness.kernels.experts.gated_fast_experts import GatedFastExperts
from moe_lora_harness.kernels.experts.marlin_experts import MarlinExperts
from moe_lora_harness.kernels.experts.oai_experts import OAIExperts
from moe_lora_harness.kernels.experts.triton_experts import TritonExperts

# Fastest first: the gated-SiLU fast path, the gather/scatter kernels gpt-oss models use, the general
# Triton experts, then the weight-only quantized experts.
BACKEND_PRIORITY = (GatedFastExperts, OAIExperts, TritonExperts, MarlinExperts)


class NoBackendError(ValueError):
    """No experts class supports the config; the message lists every backend with its reason."""


def explain(config: MoEConfig, priority=BACKEND_PRIORITY) -> list[tuple[str, bool, str]]:
    """[(backend name, ok, reason)] for every backend, in priority order."""
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig; got {type(config).__name__}")
    return [(cls.name, *cls.is_supported_config(config)) for cls in priority]


def select_experts(config: MoEConfig, priority=BACKEND_PRIORITY) -> type:
    """The first class in `priority` whose is_supported_config(config) is ok; NoBackendError if none."""
    rows = explain(config, priority)
    for cls, (_, ok, _) in zip(priority, rows):
        if ok:
            return cls
    lines = "; ".join(f"{name}: {reason}" for name, _, reason in rows)
    raise NoBackendError(f"no experts backend supports {config}: {lines}")
