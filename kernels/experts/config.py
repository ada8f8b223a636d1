"""The expert layer's static configuration (`MoEConfig`): what a backend must be able to run.

Holds structure only (device kind, dtype, activation, sizes, features), never tensors, so the oracle can
choose a backend from declarations alone before any weight exists.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_lora_harness.kernels.dtypes import DTYPE_NAMES
from moe_lora_harness.kernels.fp8_schemes import FP8_SCHEMES

FP8_QUANTS = tuple(FP8_SCHEMES)

DEVICES = ("cpu", "cuda")
QUANT_SCHEMES = ("none", "int4_g128", "int8_channel", *FP8_QUANTS)   # weight-only int, then FP8 (e4m3 activations)


def is_gated_activation(name: str) -> bool:
    """Gated (act(gate) * up, w13 width 2I) unless the name ends in `_no_mul` (vLLM's naming rule)."""
    return not name.endswith("_no_mul")


@dataclass(frozen=True)
class MoEConfig:
    """One expert layer: device kind, dtype, activation, H, I, local E, top_k and its features.

    `expert_map` is a flag (expert parallelism: an expert map is given and some pairs are non-local);
    `max_lora_rank` is 0 when LoRA is off. Invalid values raise ValueError/TypeError naming the field.
    """

    device: str
    dtype: torch.dtype
    activation: str
    H: int
    I: int
    E: int
    top_k: int
    has_bias: bool = False
    quant: str = "none"
    lora_enabled: bool = False
    max_lora_rank: int = 0
    expert_map: bool = False
    fully_sharded: bool = False
    apply_router_weight_on_input: bool = False

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(f"MoEConfig.device must be one of {DEVICES} (a device kind); got {self.device!r}")
        if self.dtype not in DTYPE_NAMES:
            raise TypeError(f"MoEConfig.dtype must be one of {list(DTYPE_NAMES)}; got {self.dtype!r}")
        if not isinstance(self.activation, str) or not self.activation:
            raise TypeError(f"MoEConfig.activation must be a non-empty str; got {self.activation!r}")
        for name in ("H", "I", "E", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MoEConfig.{name} must be an int >= 1; got {v!r}")
        if self.quant not in QUANT_SCHEMES:
            raise ValueError(f"MoEConfig.quant must be one of {QUANT_SCHEMES}; got {self.quant!r}")
        r = self.max_lora_rank
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"MoEConfig.max_lora_rank must be an int >= 0; got {r!r}")
        if self.lora_enabled and r < 1:
            raise ValueError(f"MoEConfig.max_lora_rank must be >= 1 when lora_enabled; got {r}")
        if self.apply_router_weight_on_input and self.top_k != 1:
            raise ValueError(f"MoEConfig.apply_router_weight_on_input needs top_k == 1; got top_k={self.top_k}")
        if self.fully_sharded and not self.lora_enabled:
            raise ValueError("MoEConfig.fully_sharded describes the LoRA weights: it needs lora_enabled=True")

    @property
    def gated(self) -> bool:
        """True for act-and-mul activations (w13 output 2I split into gate and up)."""
        return is_gated_activation(self.activation)

    @property
    def N1(self) -> int:
        """Width of the w13 output: 2I gated, I non-gated."""
        return 2 * self.I if self.gated else self.I

    @property
    def dtype_name(self) -> str:
        """The dtype as the capability tables spell it (float16, bfloat16, float32)."""
        return DTYPE_NAMES[self.dtype]
