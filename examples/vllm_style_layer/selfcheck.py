"""Quick self-test of the example layer through its harness wrapper (not part of the harness suites).

Builds the layer (H=32, I=24, E=4, k=2, fp32), loads one adapter into slot 0, maps tokens [0, -1, 0, -1]
and checks that unmapped rows are bit-identical to the LoRA-disabled twin and mapped rows differ from it.
Run from the repository root: `python examples/vllm_style_layer/selfcheck.py` (installed or not).
"""
from __future__ import annotations

import math
import os
import sys

import torch

try:
    import vllm_style_layer  # noqa: F401  (installed with pip install -e examples/vllm_style_layer)
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "src"))

from moe_lora_harness import ExpertAdapter, LayerBatch, LayerConfig, LayerWeights

from vllm_style_layer.harness_adapter import SPEC, make_layer


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-element bit equality (tells -0.0 from 0.0, NaN payloads apart)."""
    return a.view(torch.int32) == b.view(torch.int32)


def main() -> int:
    """Run the checks; 0 when they pass."""
    torch.manual_seed(0)
    cfg = LayerConfig(H=32, I=24, E=4, top_k=2, activation="silu", dtype="float32", max_loras=2, max_rank=8,
                      bias=True)
    H, I, E, dt = cfg.H, cfg.I, cfg.E, cfg.torch_dtype
    weights = LayerWeights(w13=torch.randn(E, 2 * I, H, dtype=dt) / math.sqrt(H),
                           w2=torch.randn(E, H, I, dtype=dt) / math.sqrt(I),
                           w13_bias=0.5 * torch.randn(E, 2 * I, dtype=dt), w2_bias=0.5 * torch.randn(E, H, dtype=dt))
    layer = SPEC.layer(cfg, weights)
    twin = make_layer(cfg.twin(), weights)

    layer.load_adapter(0, ExpertAdapter.random(E, H, I, rank=4, gated=True, scaling=0.5))
    mapping = torch.tensor([0, -1, 0, -1], dtype=torch.int32)
    layer.set_mapping(mapping)

    x = torch.randn(4, H, dtype=dt)
    logits = torch.randn(4, E, dtype=torch.float32)
    w, ids = layer.layer.route(logits)        # the layer's own router: what the harness routes with, too
    batch = LayerBatch(x, logits, w, ids.to(torch.int32))
    out, base = layer.forward(batch), twin.forward(batch)

    failures = []
    if tuple(out.shape) != (4, H) or out.dtype != dt:
        failures.append(f"output is {tuple(out.shape)} {out.dtype}, expected (4, {H}) {dt}")
    none = mapping < 0
    if not bool(same_bits(out[none], base[none]).all()):
        failures.append("rows mapped to -1 are not bit-identical to the LoRA-disabled twin")
    if bool(same_bits(out[~none], base[~none]).all(dim=1).any()):
        failures.append("a row mapped to slot 0 equals the base output (the adapter was not applied)")
    # unloading slot 0: every row is the base computation again
    layer.unload_adapter(0)
    if not bool(same_bits(layer.forward(batch), base).all()):
        failures.append("after unload_adapter(0), rows mapped to slot 0 differ from the twin")

    for f in failures:
        print("FAIL:", f)
    if not failures:
        print(f"selfcheck passed: rows {none.nonzero().flatten().tolist()} bit-identical to the twin, rows "
              f"{(~none).nonzero().flatten().tolist()} carry the adapter (max |delta| "
              f"{float((out - base).abs().max()):.3g}); unload restores the base")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
