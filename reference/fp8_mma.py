"""The sm_90 e4m3 tensor-core dot, bit for bit: the arithmetic an FP8 GEMM's accumulation runs on an H100/H200.

Each MMA step takes 32 products of e4m3 operands and the running value C. It finds E, the largest of C's exponent
and the products' exponent *sums* e(a) + e(b) (e = floor(log2 |x|): the alignment is set before the product of the
significands, which may reach 2, is known), truncates C and every product toward zero to a multiple of 2^(E - 13),
adds those exactly, and truncates the sum toward zero to 14 significant bits. A kernel that promotes every `tile`
products restarts each tile at zero and adds it to an fp32 register (round to nearest); one that does not chains C
through the whole K. Found and checked on an H100 with Triton's tl.dot (bench/probe_fp8_mma_model.py: 58 runs,
237,568 results, every one equal; docs/error-model.md, "The e4m3 MMA's arithmetic, bit for bit"). `scaled_gemm` is
an FP8 base GEMM on it, scales applied as production applies them: what the emulation of a backend that declares its
promotion (harness.spec.contract.BackendSpec.fp8_mma) computes on an sm_90 GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_lora_harness.reference.precision import _round_elements, rnd
from moe_lora_harness.reference.fp8 import BLOCK, check_scheme

STEP = 32                 # products per MMA step (sm_90 e4m3 wgmma: k = 32)
WINDOW_BITS = 13          # fraction bits kept below the step's largest exponent (sum)
RESULT_BITS = 14          # significant bits of a step's result
_FP32_MAX = float(torch.finfo(torch.float32).max)
_NONE = -1000             # the exponent of 0: never the largest, and 2^(_NONE - 13) is still a float64


def is_tile(tile) -> bool:
    """Whether `tile` can be a promotion interval: a positive int multiple of STEP (an MMA step's products)."""
    return isinstance(tile, int) and not isinstance(tile, bool) and tile > 0 and tile % STEP == 0


def exponent(x: torch.Tensor) -> torch.Tensor:
    """floor(log2 |x|) of float64 `x` (an e4m3 subnormal's own), _NONE at 0."""
    _, e = torch.frexp(x.abs())
    return torch.where(x == 0, torch.full_like(e, _NONE), e - 1)


def truncate_result(s: torch.Tensor) -> torch.Tensor:
    """A step's exact sum as the step keeps it: truncated toward zero to RESULT_BITS significant bits."""
    return _round_elements(s, RESULT_BITS, -126, _FP32_MAX, toward_zero=True)


def window_sum(c: torch.Tensor, p: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """c (M, N) and products p (M, N, k) each truncated toward zero to 2^(e - WINDOW_BITS), summed exactly, the sum
    truncated (`truncate_result`): a step whose window is set by exponent `e` (M, N)."""
    unit = torch.ldexp(torch.ones_like(c), e - WINDOW_BITS)
    return truncate_result((torch.trunc(p / unit.unsqueeze(-1)).sum(dim=-1) + torch.trunc(c / unit)) * unit)


def mma_step(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One step: c (M, N) plus a (M, k) @ b (N, k)^T, k <= STEP, all float64 holding e4m3 (a, b) and fp32 (c)
    values; the module doc's arithmetic, its window set by the largest exponent sum."""
    p = a.unsqueeze(1) * b.unsqueeze(0)                         # (M, N, k): exact, 4 + 4 significant bits
    ep = exponent(a).unsqueeze(1) + exponent(b).unsqueeze(0)
    ep = torch.where(p == 0, torch.full_like(ep, _NONE), ep)
    return window_sum(c, p, torch.maximum(ep.amax(dim=-1), exponent(c)))


def mma_dot(a: torch.Tensor, b: torch.Tensor, c0: torch.Tensor, tile: int | None = None) -> torch.Tensor:
    """c0 + a (M, K) @ b (N, K)^T as the e4m3 MMA computes it, in K order (float64 in and out): chained through K
    (`tile` None) or promoted every `tile` products (a multiple of STEP) into an fp32 register."""
    K = a.shape[1]
    if tile is not None and not is_tile(tile):
        raise ValueError(f"tile must be a positive multiple of {STEP} (products per MMA step) or None; got {tile!r}")
    if tile is None:
        c = c0.to(torch.float64)
        for k0 in range(0, K, STEP):
            c = mma_step(c, a[:, k0:k0 + STEP], b[:, k0:k0 + STEP])
        return c
    out = c0.to(torch.float64)
    for t0 in range(0, K, tile):
        c = torch.zeros_like(out)
        for k0 in range(t0, min(t0 + tile, K), STEP):
            c = mma_step(c, a[:, k0:k0 + STEP], b[:, k0:k0 + STEP])
        out = rnd(out + c, torch.float32)
    return out


CHUNK_VALUES = 1 << 24     # products one step of `scaled_gemm` holds at once (float64: 128 MiB per temporary)


def _dot_rows(a: torch.Tensor, b: torch.Tensor, tile: int | None) -> torch.Tensor:
    """mma_dot(a, b, 0, tile) over chunks of a's rows, each step's products at most CHUNK_VALUES."""
    if a.shape[0] == 0:
        return a.new_zeros(0, b.shape[0])
    rows = max(1, CHUNK_VALUES // (b.shape[0] * STEP))
    pieces = [a[i:i + rows] for i in range(0, a.shape[0], rows)]
    return torch.cat([mma_dot(p, b, p.new_zeros(p.shape[0], b.shape[0]), tile) for p in pieces])


def scaled_gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, scheme: str,
                tile: int | None) -> torch.Tensor:
    """One expert's FP8 base GEMM as an sm_90 kernel computes it (float64 holding fp32, (M, N)): e4m3 values xq (M, K)
    with scales xs (M, 1) or (M, K/128), weight values wq (N, K) with scales ws (N,) or (N/128, K/128).
    "fp8_w8a8": the MMA over the whole K (chained, `tile` None, or promoted every `tile` products), then times xs and
    ws, each product rounded to fp32. "fp8_block": each 128-wide K block's MMA from zero (promoted within it where
    `tile` < 128) times its two scales, added to an fp32 accumulator in K order. The fp32 roundings after the MMA
    follow one order; a kernel's own order (or a fused multiply-add) differs from it by fp32 roundings, which the
    accumulation variance allows."""
    block, _ = check_scheme(scheme)
    if block is None:
        return rnd(rnd(_dot_rows(xq, wq, tile) * xs[:, :1], torch.float32) * ws.reshape(1, -1), torch.float32)
    K = xq.shape[1]
    inner = tile if tile is not None and tile < BLOCK else None
    acc = None
    for g, k0 in enumerate(range(0, K, BLOCK)):
        c = _dot_rows(xq[:, k0:k0 + BLOCK], wq[:, k0:k0 + BLOCK], inner)
        col = ws[:, g].repeat_interleave(BLOCK)[:wq.shape[0]]
        part = rnd(rnd(c * xs[:, g:g + 1], torch.float32) * col.reshape(1, -1), torch.float32)
        acc = part if acc is None else rnd(acc + part, torch.float32)
    return acc


@dataclass(frozen=True)
class KernelMMA:
    """A kernel's FP8 base GEMMs as the emulation runs them on the MMA (reference.experts.moe_experts_forward's
    `fp8_mma`): its promotion (`tile` products per promoted tile, None: chained through K) and each GEMM's weights,
    (e4m3 codes (E, N, K), fp32 scales) as the kernel reads them."""

    tile: int | None
    w13: tuple
    w2: tuple

    def __post_init__(self):
        if self.tile is not None and not is_tile(self.tile):
            raise ValueError(f"tile must be a positive multiple of {STEP} or None (chained); got {self.tile!r}")
