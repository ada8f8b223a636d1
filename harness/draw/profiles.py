"""Size profiles: how large cases are on each device, small under the CPU's Triton interpreter, real on a GPU.

The one table of sizes: the check rows' base shapes (harness.check.features, harness.draw.covering) and the bounds of
the free draws (harness.draw.strategies: conformance, fuzz, selftest). On the CPU every number is what its user
had before the table; the GPU has one set of draw bounds for all (docs/architecture.md says why).
"""
from __future__ import annotations

import os
from dataclasses import dataclass


def on_gpu(device: str) -> bool:
    """Whether `device` takes the GPU profile (cuda, cuda:N)."""
    return str(device).startswith("cuda")


@dataclass(frozen=True)
class Shapes:
    """The base shapes of a check row (and of the pairwise rows) on a device."""

    T: int
    H: int
    I: int
    E: int
    top_k: int
    max_rank: int
    dtype: str
    dtypes: tuple = ("float16", "float32")   # what this profile's device computes in, `dtype` first
    small: bool = True                        # the interpreter-sized profile (Feature.small_cases applies)
    past_blocks: tuple = (17, 33)             # token counts one past a block (16 rows; GPU 128), one past two


SMALL = Shapes(T=6, H=64, I=48, E=4, top_k=2, max_rank=8, dtype="float16")
LARGE = Shapes(T=96, H=512, I=384, E=16, top_k=4, max_rank=32, dtype="bfloat16",
               dtypes=("bfloat16", "float32", "float16"), small=False, past_blocks=(129, 257))
PROFILES = (SMALL, LARGE)



@dataclass(frozen=True)
class LayerShapes:
    """A stateful layer's configuration on a device (harness.layer.layer_scenarios builds its scenarios from it)."""

    H: int
    I: int
    E: int
    top_k: int
    max_loras: int
    max_rank: int
    max_tokens: int
    capture_sizes: tuple
    dtypes: tuple                      # the scenario rows' dtypes: every scenario in the first
    every_dtype: bool = False          # every scenario in every dtype too (else the first scenario only)


# On the CPU every forward runs the layer and its twin in the interpreter: small, one block of tokens.
SMALL_LAYER = LayerShapes(H=32, I=32, E=4, top_k=2, max_loras=3, max_rank=8, max_tokens=8, capture_sizes=(4, 8),
                          dtypes=("float16", "float32"))
# On a GPU: vLLM-like capture sizes up to a 256-token batch.
LARGE_LAYER = LayerShapes(H=512, I=384, E=16, top_k=4, max_loras=4, max_rank=32, max_tokens=256,
                          capture_sizes=(1, 8, 64, 256), dtypes=("bfloat16", "float16", "float32"), every_dtype=True)

SIZES_ENV = "MOE_LORA_HARNESS_SIZES"   # small | large: override the per-device default


def shapes_for(device: str) -> Shapes:
    """SMALL under the interpreter, LARGE on a GPU, unless MOE_LORA_HARNESS_SIZES says otherwise."""
    forced = os.environ.get(SIZES_ENV, "")
    if forced:
        if forced not in ("small", "large"):
            raise ValueError(f"{SIZES_ENV} must be 'small' or 'large'; got {forced!r}")
        return LARGE if forced == "large" else SMALL
    return LARGE if on_gpu(device) else SMALL


@dataclass(frozen=True)
class DrawSizes:
    """The bounds of a free draw: tokens up to max_T (the block-edge regime goes past it), dims up to max_dim."""

    max_T: int
    max_dim: int

    def kw(self) -> dict:
        return dict(max_T=self.max_T, max_dim=self.max_dim)


# Under the interpreter every example is slow: the expert level (two GEMMs per expert) draws fewer tokens.
CPU_DRAWS = {"op": DrawSizes(12, 96), "expert": DrawSizes(10, 96), "ep": DrawSizes(12, 96)}
# selftest's fuzz detector on the CPU draws smaller still: its kill matrix (which planted bug is caught, after
# how many examples) was measured at these sizes, and CI's selftest verdicts rest on it
SELFTEST_CPU_DRAWS = DrawSizes(10, 64)
# One GPU set for every level and user: the fuzz profile, at which the compile-class palettes were built and
# measured (bench/bench_fuzz.py, bench/compile_keys.py); it reaches the bulk token window (130..256) and dims
# past 512, where a tile loop runs more than twice
GPU_DRAWS = DrawSizes(256, 1024)


def layer_shapes_for(device: str) -> LayerShapes:
    """SMALL_LAYER under the interpreter, LARGE_LAYER on a GPU (MOE_LORA_HARNESS_SIZES overrides, as for cases)."""
    return LARGE_LAYER if shapes_for(device) is LARGE else SMALL_LAYER


def draw_sizes(device: str, level: str) -> dict:
    """max_T / max_dim of the free draws of `level` (op, expert, ep) on `device`."""
    return (GPU_DRAWS if on_gpu(device) else CPU_DRAWS[level]).kw()


def selftest_draw_sizes(device: str) -> dict:
    """max_T / max_dim of selftest's fuzz detector on `device`."""
    return (GPU_DRAWS if on_gpu(device) else SELFTEST_CPU_DRAWS).kw()
