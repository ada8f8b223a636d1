"""FP8 (e4m3) schemes with quantized activations: "fp8_w8a8" and DeepSeek-V3's "fp8_block" (docs/semantics.md 9.1).

Everything here is float64 emulation of the e4m3 grid (4 significant bits, min normal 2^-6, subnormal spacing 2^-9,
max 448, nearest-even) with saturation; the error-model allowance for an activation element that a production
kernel may round to the neighbouring e4m3 value is `flip_allowance` (docs/error-model.md, "FP8 activations").

torch.float8_e4m3fn's CPU cast saturates in torch 2.13 (448 < |v|, even inf, gives +-448; ties round to even) but
gives NaN in torch 2.11 (measured on the H200 machine): a kernel cannot rely on a cast's overflow on every device,
version and dtype path (e4m3fn has no inf), so vLLM's quantizers clamp to +-448 first, and so does everything here
(`suites/experts/test_fp8.py` checks the rounding against torch's cast of clamped values).
"""
from __future__ import annotations

import torch

from moe_lora_harness.reference.precision import _round_bits

E4M3_MAX = 448.0
E4M3_BITS, E4M3_EMIN = 4, -6          # significant bits incl. the implicit one; exponent of the smallest normal
BLOCK = 128
# scheme -> (weight block (rows, cols) or None = one scale per output channel, activation group along K or None =
# one scale per token row)
SCHEMES = {"fp8_w8a8": (None, None), "fp8_block": ((BLOCK, BLOCK), BLOCK)}
# the dynamic activation scale's floor on amax (a zero row quantizes to zeros instead of 0/0)
AMAX_FLOOR = 1e-10
# relative difference, in the e4m3 operand x / s, that two correct fp32 implementations of the scale arithmetic
# may show: amax / 448 rounded once or as amax * fp32(1/448) (1 ulp), x / s or x * fp32(1/s) (2 ulps): 4 fp32 ulps
FP32_SLACK = 4 * 2.0 ** -23
# the per-element bound's ulps of the working dtype (harness.judge.compare.ULPS; equality is tested): the error model's
# claim on how far a correct kernel's activation may lie from the truth's, which sets the window of GEMM2 flips
A_BOUND_ULPS = 4.0
# `flip_chance`: how many standard deviations of their deviations an element's magnitude may lie below its group's
# amax and still be the kernel's amax: the statistical model's per-element tail at 1e-9 over up to 2^32 elements
# (harness.judge.compare.sigmas(2^32); the model's rounding errors are sub-Gaussian, as rule 2's statistical form
# takes them)
AMAX_SIGMAS = 9.34
_F64, _F32 = torch.float64, torch.float32


def check_scheme(name: str) -> tuple:
    """The scheme's (weight block, activation group); ValueError naming `scheme` otherwise."""
    if name not in SCHEMES:
        raise ValueError(f"scheme must be one of {sorted(SCHEMES)}; got {name!r}")
    return SCHEMES[name]


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float `v` -> float64 on the e4m3 grid: clamped to +-448 (saturation), then nearest-even, subnormals kept."""
    v = v.to(_F64).clamp(-E4M3_MAX, E4M3_MAX)
    return _round_bits(v, E4M3_BITS, E4M3_EMIN, E4M3_MAX)


def e4m3_ulp(m: torch.Tensor) -> torch.Tensor:
    """The e4m3 spacing above |m| (float64): 2^(max(floor(log2|m|), -6) - 3); 2^-9 at 0."""
    _, ex = torch.frexp(m.to(_F64).abs())
    return torch.ldexp(torch.ones_like(m, dtype=_F64), (ex.to(torch.int64) - 1).clamp(min=E4M3_EMIN) - 3)


# -- weights: snapped once by the builders, handed over as codes and fp32 scales ---------------------------------

SCALE_BITS = 4   # significant bits of a weight scale: code (4) x scale (4) fits bf16's 8 exactly


def _weight_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 rounded UP to SCALE_BITS significant bits (fp32): |w / s| <= 448, and code x scale is exact in
    bf16 and fp16 (docs/semantics.md 9.1); neighbouring blocks' scales still differ, so a wrong block shows."""
    m, ex = torch.frexp((amax.to(_F64) / E4M3_MAX).clamp_min(2.0 ** -100))
    return torch.ldexp(torch.ceil(m * 2 ** SCALE_BITS), ex - SCALE_BITS).to(_F32)


def weight_scale_view(scales: torch.Tensor, N: int, K: int, scheme: str) -> torch.Tensor:
    """One expert's scales (N,) or (N/128, K/128) expanded to (N, K), float64."""
    block, _ = check_scheme(scheme)
    s = scales.to(_F64)
    if block is None:
        return s.unsqueeze(1).expand(N, K)
    return s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)


def quantize_weights(w: torch.Tensor, scheme: str):
    """w (E, N, K) -> (codes float8_e4m3fn (E, N, K), scales fp32: (E, N) per channel, (E, N/128, K/128) blocks).

    Scales are amax / 448 rounded up to 4 significant bits, so |w / s| <= 448 and codes x scale are exact in the
    working dtype: the dequantized weights handed to the reference are exactly what the kernel multiplies."""
    block, _ = check_scheme(scheme)
    if w.dim() != 3:
        raise ValueError(f"w must be (E, N, K); got shape {tuple(w.shape)}")
    E, N, K = w.shape
    if block is not None and (N % block[0] or K % block[1]):
        raise ValueError(f"{scheme} needs N and K divisible by {block}; got N={N}, K={K}")
    codes = torch.empty((E, N, K), dtype=torch.float8_e4m3fn, device=w.device)
    shape = (E, N) if block is None else (E, N // block[0], K // block[1])
    scales = torch.empty(shape, dtype=_F32, device=w.device)
    for e in range(E):
        a = w[e].to(_F64).abs()
        amax = a.amax(dim=1) if block is None else a.view(N // block[0], block[0], K // block[1], block[1]).amax((1, 3))
        scales[e] = _weight_scale(amax)
        codes[e] = round_e4m3(w[e].to(_F64) / weight_scale_view(scales[e], N, K, scheme)).to(torch.float8_e4m3fn)
    return codes, scales


def dequantize_weights(codes: torch.Tensor, scales: torch.Tensor, scheme: str, dtype: torch.dtype) -> torch.Tensor:
    """(codes, scales) -> weights in `dtype`: code x scale, checked exact (ValueError otherwise), one expert at a time."""
    E, N, K = codes.shape
    out = torch.empty((E, N, K), dtype=dtype, device=codes.device)
    for e in range(E):
        exact = codes[e].to(_F64) * weight_scale_view(scales[e], N, K, scheme)
        out[e] = exact.to(dtype)
        if not torch.equal(out[e].to(_F64), exact):
            raise ValueError(f"{scheme}: expert {e}'s dequantized weights are not exact in {dtype} (scales too small "
                             f"for its subnormals); the reference would judge other weights than the kernel's")
    return out


# -- activations: dynamic, per token (w8a8) or per token and group of 128 along K (block) ------------------------

def _groups(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """(P, K) -> (P, G, g): one row per token (w8a8) or groups of 128 along K (block)."""
    _, group = check_scheme(scheme)
    P, K = x.shape
    if group is None:
        return x.reshape(P, 1, K)
    if K % group:
        raise ValueError(f"{scheme} needs the activation width K divisible by {group}; got K={K}")
    return x.reshape(P, K // group, group)


def quantize_activation(x: torch.Tensor, scheme: str):
    """x (P, K) -> (q, s): e4m3 values q (P, K) and each group's scale s (P, K), float64 holding fp32 values.

    Production's dynamic quantizer in fp32: amax of the group, s = amax / 448 (floored), v = x / s, each rounded
    once to fp32; q = e4m3(clamp(v)). The dequantized activation the base GEMM reads is q x s (exact in float64)."""
    P, K = x.shape
    g = _groups(x.to(_F32).to(_F64), scheme)
    amax = g.abs().amax(dim=2, keepdim=True).clamp_min(AMAX_FLOOR)
    s = (amax / E4M3_MAX).to(_F32).to(_F64)
    q = round_e4m3((g / s).to(_F32))
    return q.reshape(P, K), s.expand_as(g).reshape(P, K)


def fake_quantize_activation(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """The dequantized activation q x s (P, K), float64."""
    q, s = quantize_activation(x, scheme)
    return q * s


def _flip_terms(x: torch.Tensor, err: torch.Tensor, scheme: str):
    """(near, step, |q|, rel, s, dist) of `flip_allowance`, each (P, K) float64: whether v = x / s lies within the
    window of an e4m3 rounding boundary, the e4m3 spacing above |q|, |q|, the scale's relative shift, s and v's
    distance to the nearest boundary (in units of v)."""
    q, s = quantize_activation(x, scheme)
    P, K = x.shape
    err = err.to(_F64)
    ax = _groups(x.to(_F64).abs(), scheme)
    amax = ax.amax(dim=2, keepdim=True).clamp_min(AMAX_FLOOR)
    # the kernel's amax lies within [amax - err(argmax), max(|x| + err)]: the scale's relative shift
    grow = (ax + _groups(err, scheme)).amax(dim=2, keepdim=True) - amax
    rel = (grow / amax + FP32_SLACK).expand_as(ax).reshape(P, K)
    v = x.to(_F64) / s
    window = err / s + v.abs() * rel
    qm, vm = q.abs(), v.abs()
    step_up = e4m3_ulp(qm)
    _, ex = torch.frexp(qm)
    is_pow2 = (qm > 2.0 ** E4M3_EMIN) & (torch.ldexp(torch.full_like(qm, 0.5), ex) == qm)
    step_down = torch.where(is_pow2, step_up / 2, step_up)
    dist_up = torch.where(qm >= E4M3_MAX, torch.full_like(qm, float("inf")), qm + step_up / 2 - vm)
    dist_down = torch.where(qm == 0, torch.full_like(qm, float("inf")), vm - (qm - step_down / 2))
    dist = torch.minimum(dist_up, dist_down)
    return dist <= window, step_up, qm, rel, s, dist


def flip_allowance(x: torch.Tensor, err: torch.Tensor, scheme: str) -> torch.Tensor:
    """(P, K) float64: how far a correct kernel's dequantized activation may lie from `quantize_activation(x)`'s,
    per element, when its own x may differ from this x by up to `err` (absolute, per element; 0: the same x).

    The kernel's scale may differ by rel = (max(|x| + err) - amax) / amax + FP32_SLACK over the group (relative; the
    kernel's amax is at most that high, and at least amax - err there, which max(|x| + err) bounds), its operand
    v = x / s by err / s + |v| rel. An element whose v lies that close to an e4m3 rounding boundary may round to
    the neighbouring value: one e4m3 step (at most the spacing above |q|) times s. Every element's q x s also moves
    by |q| s rel with the scale. Derivation: docs/error-model.md, "FP8 activations"."""
    near, step_up, qm, rel, s, _ = _flip_terms(x, err, scheme)
    return (near.to(_F64) * step_up + qm * rel) * s


def flip_step(x: torch.Tensor, err: torch.Tensor, scheme: str) -> torch.Tensor:
    """(P, K) float64: `flip_allowance` without the scale's shift: one e4m3 step times s where the element may flip,
    0 elsewhere. What a single flip moves one element by (the aggregate floor's one flip)."""
    near, step_up, _, _, s, _ = _flip_terms(x, err, scheme)
    return near.to(_F64) * step_up * s


def flip_chance(x: torch.Tensor, err: torch.Tensor, dev_sq, scheme: str):
    """(P, K) float64: a bound on the probability that a correct kernel's e4m3 code of each element differs from
    `quantize_activation(x)`'s, when its own x differs from this x by a deviation of expected square at most `dev_sq`
    (absolute^2, per element) and never by more than `err` (the worst case, as `flip_allowance` takes it). `dev_sq`
    a list of such tensors: a list of bounds, the quantization's terms computed once for all.

    The kernel's v = x / s moves by dv = dx / s - v da / amax (its scale follows its group's amax, which moves by at
    most the deviation of an element that may be the kernel's largest: within err of the top, and within AMAX_SIGMAS
    of the two elements' deviations' root sum square; E da^2 <= their dev_sq summed), so
    sqrt(E dv^2) <= m = sqrt(dev_sq) / s + |v| sqrt(E da^2) / amax. A flip needs |dv| past v's distance to the
    boundary less the scale arithmetic's slack (|v| FP32_SLACK, where it is certain): Chebyshev's inequality,
    min(1, m^2 / margin^2), for any distribution of the deviation; 0 outside the worst-case window.
    docs/error-model.md, "FP8 rows in rule 4"."""
    near, _, _, _, s, dist = _flip_terms(x, err, scheme)
    ax, e_g = (_groups(t.to(_F64).abs(), scheme) for t in (x, err))
    amax, top = ax.max(dim=2, keepdim=True)
    gap = amax - ax       # elements that may be the kernel's amax: the worst case, and the statistical tail
    worst = gap <= e_g + e_g.gather(2, top)
    amax = amax.clamp_min(AMAX_FLOOR)
    v = (x.to(_F64) / s).abs()
    margin = dist - v * FP32_SLACK

    def chance(d: torch.Tensor) -> torch.Tensor:
        d_g = _groups(d.to(_F64).abs(), scheme)
        da_sq = (d_g * (worst & (gap <= AMAX_SIGMAS * (d_g + d_g.gather(2, top)).sqrt()))).sum(dim=2, keepdim=True)
        m = d.to(_F64).clamp_min(0).sqrt() / s + v * (da_sq.sqrt() / amax).expand_as(ax).reshape(v.shape)
        c = torch.where(margin > 0, (m / margin.clamp_min(torch.finfo(_F64).tiny)) ** 2, torch.ones_like(v))
        return torch.where(near, c.clamp(max=1.0), torch.zeros_like(v))
    return [chance(d) for d in dev_sq] if isinstance(dev_sq, (list, tuple)) else chance(dev_sq)
