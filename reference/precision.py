"""Rounding emulation: float64 truth rounded to a production dtype at the points a kernel path rounds.

`rnd` is a correctly rounded (round-to-nearest-even) float64 -> dtype -> float64 round trip.
torch's own float64 -> fp16/bf16 cast goes through fp32 and can double-round, so it is not used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# dtype -> (significant bits incl. the implicit one, minimum normal exponent)
_FORMATS = {
    torch.float16: (11, -14),
    torch.bfloat16: (8, -126),
}
_NATIVE = (torch.float32, torch.float64)  # float64 -> these casts are correctly rounded

PRESETS = (
    "exact",
    "one_shot",
    "two_kernel",
    "small_batch",
    "dual_stream",
    "dual_stream_small_batch",
)

# name -> (round_rank_intermediate, round_delta); see spec 1.4-1.6 and 5.
_PRESET_FLAGS = {
    "exact": (False, False),
    "one_shot": (True, True),
    "two_kernel": (True, True),
    "small_batch": (False, False),
    "dual_stream": (True, True),
    "dual_stream_small_batch": (False, True),
}


def _check_dtype(dtype, what: str = "dtype") -> None:
    if dtype is not None and dtype not in _FORMATS and dtype not in _NATIVE:
        raise ValueError(
            f"{what} must be None, torch.float16, torch.bfloat16, torch.float32 or torch.float64; "
            f"got {dtype!r}"
        )


def rnd(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Round `x` to `dtype` (nearest-even, overflow to inf) and return it as float64; identity if None."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point torch.Tensor; got {type(x).__name__}"
                        + (f" of dtype {x.dtype}" if isinstance(x, torch.Tensor) else ""))
    _check_dtype(dtype)
    x = x.to(torch.float64)
    if dtype is None or dtype == torch.float64:
        return x
    if dtype == torch.float32:
        return x.to(torch.float32).to(torch.float64)
    bits, emin = _FORMATS[dtype]
    finfo = torch.finfo(dtype)
    _, ex = torch.frexp(x)  # x = m * 2**ex with 0.5 <= |m| < 1, so the leading bit is 2**(ex-1)
    ulp_exp = torch.clamp(ex.to(torch.float64) - 1, min=emin) - (bits - 1)
    ulp = torch.pow(2.0, ulp_exp)
    y = torch.round(x / ulp) * ulp  # torch.round is half-to-even; x / ulp is exact
    y = torch.where(y.abs() > finfo.max, torch.copysign(torch.full_like(y, float("inf")), x), y)
    return torch.where(torch.isfinite(x), y, x)


def eps(dtype: torch.dtype) -> float:
    """Machine epsilon of `dtype` (spacing of floats just above 1), used by the error model."""
    if dtype is None:
        raise ValueError("eps: dtype must be a floating-point torch.dtype, got None")
    return float(torch.finfo(dtype).eps)


@dataclass(frozen=True)
class Precision:
    """Where a production path rounds to `dtype` (None = exact float64, nothing rounded).

    When `dtype` is set the final add into the output is always rounded; `round_rank_intermediate`
    rounds the shrink result u, `round_delta` rounds the expand result d before the add, and
    `round_base` (True in every preset) says base GEMM/activation/moe_sum values are rounded.
    """

    name: str
    dtype: torch.dtype | None
    round_rank_intermediate: bool
    round_delta: bool
    round_base: bool = True

    def r(self, x: torch.Tensor) -> torch.Tensor:
        """Round `x` (float64) to this precision's dtype; identity when exact."""
        return rnd(x, self.dtype)

    @property
    def exact(self) -> bool:
        """True when nothing is rounded (dtype None)."""
        return self.dtype is None


def precision(name: str, dtype: torch.dtype | None) -> Precision:
    """Build the named preset (see PRESETS) at `dtype`; `exact` always has dtype None."""
    if name not in _PRESET_FLAGS:
        raise ValueError(f"precision name must be one of {PRESETS}; got {name!r}")
    _check_dtype(dtype)
    if name == "exact":
        dtype = None
    rank, delta = _PRESET_FLAGS[name]
    return Precision(name=name, dtype=dtype, round_rank_intermediate=rank, round_delta=delta)


def vllm_dispatch_path(*, naive: bool, max_rank: int, num_pairs: int, fully_sharded: bool) -> str:
    """The LoRA op path vLLM 0.33.0's `fused_moe_lora` takes (spec 1.3), hence its rounding preset.

    small_batch: naive layout, rank <= 64, T*k*rank <= 1024, not fully sharded; else one_shot for rank
    <= 128 when not fully sharded; else two_kernel (any rank; the only path with the fully-sharded
    collectives). `naive` = no sorted_token_ids; `num_pairs` = T * top_k.
    """
    if fully_sharded:
        return "two_kernel"
    if naive and max_rank <= 64 and num_pairs * max_rank <= 1024:
        return "small_batch"
    return "one_shot" if max_rank <= 128 else "two_kernel"
