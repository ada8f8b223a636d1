"""One program's e4m3 dot on the tensor cores, chained or promoted: the instrument that holds a GPU's MMA to the
reference's arithmetic (reference/fp8_mma.py; suites/reference/test_fp8_mma.py, bench/probe_fp8_mma*.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, K, BLOCK_K: tl.constexpr, IMPRECISE: tl.constexpr, M: tl.constexpr,
                N: tl.constexpr):
    """c (M, N) fp32 = c + a (M, K) @ b^T, b stored (N, K) (K-major for the e4m3 MMA)."""
    rm = tl.arange(0, M)
    rn = tl.arange(0, N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.load(c_ptr + rm[:, None] * N + rn[None, :])
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :])
        b = tl.load(b_ptr + rn[None, :] * K + (k0 + rk)[:, None])
        if IMPRECISE < 0:
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc)


def e4m3_dot(a: torch.Tensor, b: torch.Tensor, c0: torch.Tensor, block_k: int, imprecise: int) -> torch.Tensor:
    """c0 + a @ b^T in one program: a (M, K), b (N, K) float8_e4m3fn, c0 (M, N) fp32, all on one CUDA device, M and
    N powers of two from 16, K a multiple of block_k; `imprecise` < 0: Triton's default (chained through K), else
    max_num_imprecise_acc (promoted every that many products)."""
    M, K = a.shape
    N = b.shape[0]
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn or b.shape[1] != K or K % block_k:
        raise ValueError(f"a (M, K) and b (N, K) must be float8_e4m3fn with K a multiple of block_k={block_k}; got "
                         f"a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} {b.dtype}")
    if tuple(c0.shape) != (M, N) or c0.dtype != torch.float32:
        raise ValueError(f"c0 must be ({M}, {N}) float32; got {tuple(c0.shape)} {c0.dtype}")
    c = c0.clone().contiguous()
    _dot_kernel[(1,)](a.contiguous(), b.contiguous(), c, K, BLOCK_K=block_k, IMPRECISE=imprecise, M=M, N=N)
    return c
