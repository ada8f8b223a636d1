"""Rounding emulation: float64 truth rounded to a production dtype at the points a kernel path rounds.

`rnd` is a correctly rounded (round-to-nearest-even) float64 -> dtype -> float64 round trip.
torch's own float64 -> fp16/bf16 cast goes through fp32 and can double-round, so it is not used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
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
    return _round_bits(x, bits, emin, torch.finfo(dtype).max)


ROUND_CHUNK = 1 << 24   # elements per pass of _round_bits over a large tensor: its temporaries stay ~0.5 GiB


def _round_bits(x: torch.Tensor, bits: int, emin: int, fmax: float, toward_zero: bool = False) -> torch.Tensor:
    """`_round_elements` over a large contiguous `x` in ROUND_CHUNK slices (every step is per element, so the bits
    are the same; a production-size (T*k, H) float64 tensor would otherwise need several float64 temporaries)."""
    if x.numel() <= ROUND_CHUNK or not x.is_contiguous():
        return _round_elements(x, bits, emin, fmax, toward_zero)
    out = torch.empty_like(x)
    flat_in, flat_out = x.view(-1), out.view(-1)
    for start in range(0, x.numel(), ROUND_CHUNK):
        sl = slice(start, start + ROUND_CHUNK)
        flat_out[sl] = _round_elements(flat_in[sl], bits, emin, fmax, toward_zero)
    return out


NUMPY_ROUND_MAX = 1 << 16   # elements up to which a CPU tensor is rounded in NumPy (_round_elements)
CAST_ROUND_MIN = 1 << 12    # elements above which a CPU tensor is rounded to float16/bfloat16 by casts


# (significant bits, min normal exponent, max finite) of the formats a torch dtype holds: rounded by casts
_CAST_DTYPES = {(bits, emin, float(torch.finfo(dt).max)): dt for dt, (bits, emin) in _FORMATS.items()}


def _round_elements(x: torch.Tensor, bits: int, emin: int, fmax: float, toward_zero: bool = False) -> torch.Tensor:
    """float64 `x` rounded (nearest-even) to `bits` significant bits, exponent >= emin (subnormals below),
    |values| above `fmax` to inf; `toward_zero`: truncated instead (the dropped bits cleared). Computed on float64's
    bits, without its exponent (several times faster than frexp and a division; bit for bit the same values,
    suites/reference/test_rounding.py): at or above 2^emin the low 53 - bits of the significand are rounded away, a
    carry moving into the exponent as it should; below, every value is a multiple of the one step
    2^(emin - bits + 1), to which adding and subtracting 1.5 * 2^52 steps rounds its magnitude (exact, nearest-even),
    the sign put back after. Every constant is a Python float, exact on every device (CUDA's pow(2.0, e) is not).
    A small CPU tensor is rounded by the same steps in NumPy (IEEE too, the same bits): torch's per-operation overhead
    made this the reference's costliest function on the suites' small tensors (64 values: 79 us a call, NumPy 27 us;
    at 2^18 torch is the faster). To float16 and bfloat16 a tensor past CAST_ROUND_MIN values on the CPU (every one
    on a GPU) is rounded by casts instead (`_round_by_casts`: the same bits; on the CPU 1.4-2.3 times NumPy's speed at
    2^14-2^16 values, 4-6 times torch's steps at 2^20)."""
    small = x.device.type == "cpu" and x.numel() <= CAST_ROUND_MIN
    dt = None if toward_zero or small else _CAST_DTYPES.get((bits, emin, fmax))
    if dt is not None:
        return _round_by_casts(x, dt)
    if x.device.type == "cpu" and x.numel() <= NUMPY_ROUND_MAX:
        return _round_numpy(x, bits, emin, fmax, toward_zero)
    return _round_steps(torch, x, bits, emin, fmax, toward_zero)


def _round_by_casts(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """float64 `x` rounded nearest-even to `dt` (float16 or bfloat16), as float64. A cast from float64 goes through
    float32 and can round twice (a value just off a midpoint of `dt` lands on it), so the float32 step rounds to odd:
    toward zero, its last bit set where inexact. Then one nearest-even cast to `dt` is correct, float32 keeping at
    least two bits more than `dt` at every magnitude (Boldo and Melquiond, "Emulation of FMA and correctly rounded
    sums: proved algorithms using rounding to odd", IEEE TC 2008). Past float32's range the odd value is float32's
    largest, which rounds to inf as `x` does; NaN and inf pass through unchanged (CUDA's casts keep a NaN's
    payload bits, the CPU's do not)."""
    f = x.to(torch.float32)
    back = f.to(torch.float64)
    toward_zero = f.view(torch.int32) - (back.abs() > x.abs()).to(torch.int32)   # one step back if rounded away
    y = (toward_zero | (back != x).to(torch.int32)).view(torch.float32).to(dt).to(torch.float64)
    return torch.where(torch.isfinite(x), y, x)     # inf and NaN as they came (a NaN's bits too, as the steps keep)


def _round_numpy(x: torch.Tensor, bits: int, emin: int, fmax: float, toward_zero: bool = False) -> torch.Tensor:
    """`_round_steps` in NumPy on a CPU tensor, back as a tensor."""
    with np.errstate(all="ignore"):        # inf and NaN pass through the steps as in torch, which does not warn
        return torch.from_numpy(_round_steps(np, x.detach().numpy(), bits, emin, fmax, toward_zero))


def _round_steps(xp, x, bits: int, emin: int, fmax: float, toward_zero: bool = False):
    """`_round_elements`' steps on `x` of the array module `xp` (torch or numpy: the same operations by name)."""
    i64, f64 = (torch.int64, torch.float64) if xp is torch else (np.int64, np.float64)
    drop = 53 - bits                       # float64 holds 53 significant bits
    keep = ~((1 << drop) - 1)
    b = x.view(i64)                        # sign and magnitude: the low 63 bits round as an unsigned magnitude
    if toward_zero:
        y = (b & keep).view(f64)
    else:                                  # + half a unit less one, + the kept last bit: ties go to even
        y = ((b + ((1 << (drop - 1)) - 1) + ((b >> drop) & 1)) & keep).view(f64)
    mag = xp.abs(x)
    step = 2.0 ** (emin - bits + 1)        # the format's subnormal spacing
    below = xp.floor(mag / step) * step if toward_zero else (mag + 1.5 * 2.0 ** 52 * step) - 1.5 * 2.0 ** 52 * step
    y = xp.where(mag < 2.0 ** emin, xp.copysign(below, x), y)
    y = xp.where(xp.abs(y) > fmax, xp.where(x < 0, -math.inf, math.inf), y)   # past fmax: x is not 0
    return xp.where(xp.isfinite(x), y, x)


# GEMM operand formats of the alternative models: name -> (significant bits, min normal exponent, max finite[,
# toward zero]). tf32rz: fp32 bits fed to a TF32 tensor-core MMA unconverted, whose low 13 mantissa bits the MMA
# ignores (Triton's default tl.dot on NVIDIA: no cvt.rna; triton-lang/triton#4574, #9295 added rounding as an option)
_OPERAND_FORMATS = {
    "tf32": (11, -126, (2 - 2.0 ** -10) * 2.0 ** 127),   # fp32's range, 10 explicit mantissa bits
    "tf32rz": (11, -126, (2 - 2.0 ** -10) * 2.0 ** 127, True),
    "bf16": (8, -126, float(torch.finfo(torch.bfloat16).max)),
    "fp16": (11, -14, float(torch.finfo(torch.float16).max)),
}


# a torch dtype with each format's epsilon (for the error model's bound; compare.py reads only the epsilon)
_EPS_TWIN = {"tf32": torch.float16, "tf32rz": torch.float16, "bf16": torch.bfloat16, "fp16": torch.float16}


def rnd_format(x: torch.Tensor, fmt: str | None) -> torch.Tensor:
    """Round float64 `x` to the named format as float64 ("tf32", "bf16", "fp16": nearest-even; "tf32rz": toward
    zero); identity if None."""
    if fmt is None:
        return x
    if fmt not in _OPERAND_FORMATS:
        raise ValueError(f"format must be one of {tuple(_OPERAND_FORMATS)} or None; got {fmt!r}")
    return _round_bits(x.to(torch.float64), *_OPERAND_FORMATS[fmt])


SPACING_GUARD = 1.0 / 32   # a value this close (relatively) below the next binade takes that binade's spacing


def spacing_sq(v: torch.Tensor) -> torch.Tensor:
    """float64: the square of |v|'s binade floor 2^floor(log2 |v|), one binade up within SPACING_GUARD of the next
    (0 at 0). eps_dt^2 times it is the squared spacing of dt at a normal-range v, which v^2 only bounds (it is 0.57
    of v^2 on average, guard included): the error model's rounding exposure. The guard covers a kernel's value that lies a few
    spacings above the emulation's, across a power of two; below dt's normal range the underflow term adds the rest.
    docs/error-model.md, "The statistical model"."""
    v = v.to(torch.float64)
    if v.numel() <= ROUND_CHUNK or not v.is_contiguous():
        return _spacing_sq(v)
    out = torch.empty_like(v)            # a production-size tensor in slices: its temporaries stay ~0.5 GiB
    flat_in, flat_out = v.view(-1), out.view(-1)
    for start in range(0, v.numel(), ROUND_CHUNK):
        flat_out[start:start + ROUND_CHUNK] = _spacing_sq(flat_in[start:start + ROUND_CHUNK])
    return out


_EXPONENT_BITS = 0x7FF0000000000000    # float64's exponent field: kept alone, a value's binade floor 2^floor(log2 |v|)


def _spacing_sq(v: torch.Tensor) -> torch.Tensor:
    floor2 = ((v.abs() * (1.0 + SPACING_GUARD)).view(torch.int64) & _EXPONENT_BITS).view(torch.float64)
    return floor2 * floor2      # 0 at 0; inf where v is not finite


def eps(dtype: torch.dtype) -> float:
    """Machine epsilon of `dtype` (spacing of floats just above 1), used by the error model."""
    if dtype is None:
        raise ValueError("eps: dtype must be a floating-point torch.dtype, got None")
    return float(torch.finfo(dtype).eps)


def tiny(dtype: torch.dtype) -> float:
    """The smallest positive subnormal of `dtype` (float16 2^-24, bfloat16 2^-133): the unit of the error model's
    underflow exposure (harness.judge.compare's rule 4), in which the FP8 flip allowance is carried too."""
    f = torch.finfo(dtype)
    return f.smallest_normal * f.eps


# Alternative rounding models (variants), composable with a path preset as "<path>_<variant>[_<variant>]",
# e.g. "one_shot_tf32" (an fp32 kernel whose tl.dot uses TF32). Each is computed in float64 with roundings at
# the stated points; harness/judge/diagnose.py re-judges a failing case against them.
VARIANTS = {
    "tf32": "GEMM operands rounded to TF32 (10 explicit mantissa bits, nearest-even: cuBLAS, cvt.rna)",
    "tf32rz": "GEMM operands truncated to TF32 (low 13 bits dropped: Triton's default tl.dot on fp32, NVIDIA)",
    "bf16ops": "GEMM operands rounded to bf16",
    "rankraw": "the rank intermediate not rounded (kept at accumulator precision)",
    "rank2x": "the rank intermediate rounded twice (split-K 2: each half's partial rounded, their sum rounded)",
    "fp16acc": "GEMM products summed in fp16 (in K order, each partial sum rounded)",
    "dtacc": "every GEMM's accumulator kept in the working dtype between K tiles of ACC_TILE (a precision mistake: "
             "acc = tl.zeros(..., dtype=out.dtype); rounded after each tile but the last)",
    "out2x": "the output rounded twice (the delta rounded before the add)",
    "outacc": "the expand summed onto the output: from prev, one rank step at a time, each partial sum rounded to "
              "fp32, the delta never apart (a compiler folding `prev + dot(u, B)` into a dot that accumulates "
              "from prev)",
}
_EXCLUSIVE = (("tf32", "bf16ops"), ("tf32", "tf32rz"), ("tf32rz", "bf16ops"), ("rankraw", "rank2x"),
              ("fp16acc", "dtacc"), ("out2x", "outacc"))
ACC_TILE = 64     # dtacc's K tile: the BLOCK_K vLLM's fused_moe configurations use most


@dataclass(frozen=True)
class Precision:
    """Where a production path rounds to `dtype` (None = exact float64, nothing rounded).

    When `dtype` is set the final add into the output is always rounded; `round_rank_intermediate`
    rounds the shrink result u, `round_delta` rounds the expand result d before the add, and
    `round_base` (True in every preset) says base GEMM/activation/moe_sum values are rounded.
    The alternative models (VARIANTS) add: `operand` ("tf32"/"bf16": every GEMM input rounded to that
    format; "tf32rz": truncated to TF32), `accumulate` ("fp16": GEMM products summed in that format) and
    `rank_split` (> 1: the shrink summed in that many K parts, each rounded to `dtype`, added in `dtype`) and
    `onto_out` (the expand's rank terms added to the output's value one at a time in fp32, then rounded to `dtype`).
    Their defaults leave the path presets' computation unchanged, operation for operation.
    """

    name: str
    dtype: torch.dtype | None
    round_rank_intermediate: bool
    round_delta: bool
    round_base: bool = True
    operand: str | None = None
    accumulate: str | None = None
    rank_split: int = 1
    acc_tile: int = 0          # > 0: the accumulator rounded to `dtype` between K tiles of this many (dtacc)
    onto_out: bool = False     # the expand accumulated onto the output in fp32, rank step by rank step (outacc)

    def r(self, x: torch.Tensor) -> torch.Tensor:
        """Round `x` (float64) to this precision's dtype; identity when exact."""
        return rnd(x, self.dtype)

    @property
    def exact(self) -> bool:
        """True when nothing is rounded (dtype None)."""
        return self.dtype is None

    @property
    def bound_dtype(self) -> torch.dtype | None:
        """The dtype whose epsilon the error model's bound must use (compare_written's `dtype`): the coarsest
        of `dtype` and the GEMM operand / accumulation formats. TF32 is stood for by float16, which has the
        same epsilon 2^-10 (compare_written reads only the epsilon). `dtype` for every path preset."""
        if self.dtype is None:
            return None
        fmts = [self.dtype] + [_EPS_TWIN[f] for f in (self.operand, self.accumulate) if f is not None]
        return max(fmts, key=lambda d: torch.finfo(d).eps)

    @property
    def plain_gemm(self) -> bool:
        """True when GEMMs are exact float64 products of the given values (every path preset)."""
        return self.operand is None and self.accumulate is None and not self.acc_tile

    def bmv(self, mats: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        """out[c] = mats[c] @ vec[c] (mats (c, M, K), vec (c, K), float64), per the GEMM model."""
        if self.plain_gemm:
            return torch.bmm(mats, vec.unsqueeze(-1)).squeeze(-1)
        mats, vec = rnd_format(mats, self.operand), rnd_format(vec, self.operand)
        if self.accumulate is None:
            return torch.bmm(mats, vec.unsqueeze(-1)).squeeze(-1)
        acc = torch.zeros(mats.shape[:2], dtype=torch.float64, device=mats.device)
        for i in range(mats.shape[2]):   # products are exact in float64; every partial sum rounded
            acc = rnd_format(acc + mats[:, :, i] * vec[:, i, None], self.accumulate)
        return acc

    def mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ w^T over the last two dims (x (..., P, K), w (..., N, K), float64), per the GEMM model. Summed in
        a coarse format, every element's partial sums are elementwise steps: a batch of GEMMs in one K loop gives
        each GEMM's bits."""
        if self.plain_gemm:
            return x @ w.transpose(-1, -2)
        x, w = rnd_format(x, self.operand), rnd_format(w, self.operand)
        if self.acc_tile:           # the sum of each tile exact, the running sum rounded between tiles
            acc = None
            for k0 in range(0, x.shape[-1], self.acc_tile):
                part = x[..., k0:k0 + self.acc_tile] @ w[..., k0:k0 + self.acc_tile].transpose(-1, -2)
                acc = part if acc is None else self.r(acc) + part
            return acc
        if self.accumulate is None:
            return x @ w.transpose(-1, -2)
        acc = torch.zeros(*x.shape[:-1], w.shape[-2], dtype=torch.float64, device=x.device)
        for i in range(x.shape[-1]):
            acc = rnd_format(acc + x[..., :, i, None] * w[..., None, :, i], self.accumulate)
        return acc


def bound_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype to judge a case of working dtype `dtype` at when the backend declares preset `name`:
    `dtype` itself for every path preset (and `exact`), coarser for the variants whose operands or
    accumulation are coarser (one_shot_tf32 at fp32: float16, TF32's epsilon; *_bf16ops: bfloat16)."""
    return precision(name, dtype).bound_dtype or dtype


def split_name(name: str) -> tuple[str, tuple[str, ...]]:
    """"one_shot_tf32_rankraw" -> ("one_shot", ("tf32", "rankraw")); ValueError if not path[_variant...]."""
    if not isinstance(name, str):
        raise ValueError(f"precision name must be a str; got {type(name).__name__}")
    if name in _PRESET_FLAGS:
        return name, ()
    paths = [p for p in PRESETS if p != "exact" and name.startswith(p + "_")]
    if paths:
        path = max(paths, key=len)
        variants = tuple(name[len(path) + 1:].split("_"))
        if all(v in VARIANTS for v in variants):
            return path, variants
    raise ValueError(f"precision name must be one of {PRESETS}, optionally followed by _<variant> with variants "
                     f"from {tuple(VARIANTS)} (e.g. 'one_shot_tf32'); got {name!r}")


def compose(path: str, *variants: str) -> str:
    """The preset name of `path` with `variants` (canonical order); checked by precision()."""
    return "_".join((path,) + tuple(v for v in VARIANTS if v in variants))


def precision(name: str, dtype: torch.dtype | None) -> Precision:
    """Build the named preset (see PRESETS, optionally with VARIANTS) at `dtype`; `exact` always has dtype None.

    A variant that would change nothing in the path (rankraw / rank2x where the path keeps the intermediate
    unrounded, out2x where it already rounds the delta) or contradicts another one is rejected. The
    operand variants are accepted at every dtype: a TF32 rounding of fp16/bf16 values (or bf16 of bf16) is
    the identity, so "one_shot_tf32" can be declared for a backend at every dtype.
    """
    path, variants = split_name(name)
    _check_dtype(dtype)
    if name == "exact":
        dtype = None
    rank, delta = _PRESET_FLAGS[path]
    if not variants:
        return Precision(name=name, dtype=dtype, round_rank_intermediate=rank, round_delta=delta)
    problems = []
    if len(set(variants)) != len(variants):
        problems.append("a variant is repeated")
    problems += [f"{a} and {b} exclude each other" for a, b in _EXCLUSIVE if a in variants and b in variants]
    if ("rankraw" in variants or "rank2x" in variants) and not rank:
        problems.append(f"{path} does not round the rank intermediate (rankraw/rank2x change nothing)")
    if "out2x" in variants and delta:
        problems.append(f"{path} already rounds the delta before the add (out2x changes nothing)")
    if problems:
        raise ValueError(f"precision {name!r}: " + "; ".join(problems))
    operand = next((f for v, f in (("tf32", "tf32"), ("tf32rz", "tf32rz"), ("bf16ops", "bf16")) if v in variants),
                   None)
    return Precision(name=compose(path, *variants), dtype=dtype,
                     round_rank_intermediate=rank and "rankraw" not in variants,
                     round_delta=delta or "out2x" in variants,
                     operand=operand, accumulate="fp16" if "fp16acc" in variants else None,
                     rank_split=2 if "rank2x" in variants else 1, acc_tile=ACC_TILE if "dtacc" in variants else 0,
                     onto_out="outacc" in variants)


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
