"""The e4m3 MMA's arithmetic (reference.fp8_mma): its rule on vectors that tell it from its neighbours, and on a GPU
of compute capability 9 the hardware's tl.dot equal to it bit for bit, chained and promoted."""
from __future__ import annotations

import pytest
import torch

from moe_lora_harness.reference import fp8_mma
from moe_lora_harness.reference.fp8 import quantize_activation, quantize_weights
from moe_lora_harness.reference.fp8_mma import STEP, KernelMMA, mma_dot, scaled_gemm

F64 = torch.float64


def _dot1(pairs, c0=0.0, tile=None):
    """One output: c0 + sum a_i b_i over `pairs` (padded to one MMA step with zeros)."""
    a = torch.zeros(1, STEP, dtype=F64)
    b = torch.zeros(1, STEP, dtype=F64)
    for i, (x, y) in enumerate(pairs):
        a[0, i], b[0, i] = x, y
    return float(mma_dot(a, b, torch.full((1, 1), c0, dtype=F64), tile)[0, 0])


def test_a_step_keeps_13_fraction_bits_below_its_largest_exponent():
    for j in range(10, 16):
        got = _dot1([(1.0, 1.0), (2.0 ** -6, 2.0 ** (6 - j))])     # 1 + 2^-j
        assert got == (1.0 + 2.0 ** -j if j <= 13 else 1.0), j
    assert _dot1([(1.0, 1.0), (2.0 ** -6, 2.0 ** 1)], c0=256.0) == 257.03125       # the cut at 2^-5 next to 256
    assert _dot1([(1.0, 1.0), (2.0 ** -6, 2.0 ** 0)], c0=256.0) == 257.0
    assert _dot1([(1.0, -1.0), (2.0 ** -6, 2.0 ** -8)]) == -1.0          # -1 + 2^-14 and -1 - 2^-14: the small
    assert _dot1([(1.0, -1.0), (-(2.0 ** -6), 2.0 ** -8)]) == -1.0       # product truncated toward zero, either sign


def test_the_window_is_set_by_exponent_sums_not_by_the_products_sizes():
    """1.875^2 = 3.52 has exponent sum 0: its window keeps 2^-13, which a window on the product's own size (2^1)
    would drop; 2 x 2 (exponent sum 2) drops it."""
    tiny = (2.0 ** -7, 2.0 ** -6)                                      # 2^-13, e4m3 subnormal x normal
    kept = _dot1([(1.875, 1.875), (1.875, -1.0), tiny])               # 1.640625 + 2^-13 in [1, 2): 14 bits hold it
    assert kept == 1.640625 + 2.0 ** -13
    dropped = _dot1([(2.0, 2.0), (-1.5, 1.5), tiny])                   # 1.75 + 2^-13, window 2^-11
    assert dropped == 1.75


def test_a_promoted_tile_restarts_at_zero_and_adds_in_fp32():
    g = torch.Generator().manual_seed(5)
    a, b = ((torch.randn(8, 4 * STEP, generator=g, dtype=F64) * 16).to(torch.float8_e4m3fn).to(F64) for _ in range(2))
    c0 = torch.zeros(8, 8, dtype=F64)
    promoted = mma_dot(a, b, c0, tile=STEP)
    by_hand = c0
    for k0 in range(0, 4 * STEP, STEP):
        step = mma_dot(a[:, k0:k0 + STEP], b[:, k0:k0 + STEP], torch.zeros_like(c0))
        by_hand = (by_hand + step).to(torch.float32).to(F64)
    assert torch.equal(promoted, by_hand)
    assert not torch.equal(promoted, mma_dot(a, b, c0))               # the chained dot truncates its running value
    with pytest.raises(ValueError, match="tile must be a positive multiple of 32"):
        mma_dot(a, b, c0, tile=48)


def _operands(scheme, M=5, N=256, K=384, seed=2):
    """(xq, xs, wq, ws): an activation quantized per row / per 128-group, weights per channel / per 128 block."""
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_activation(torch.randn(M, K, generator=g, dtype=F64), scheme)
    codes, scales = quantize_weights(torch.randn(1, N, K, generator=g, dtype=F64).to(torch.bfloat16), scheme)
    xs = s[:, :1] if scheme == "fp8_w8a8" else s[:, ::128]
    return q, xs, codes[0].to(F64), scales[0].to(F64)


def _fp32(x):
    return x.to(torch.float32).to(F64)


@pytest.mark.parametrize("tile", [128, 32, None], ids=["promoted-128", "promoted-32", "chained"])
def test_a_per_channel_gemm_is_the_mma_then_the_two_scales(tile):
    xq, xs, wq, ws = _operands("fp8_w8a8")
    got = scaled_gemm(xq, xs, wq, ws, "fp8_w8a8", tile)
    assert torch.equal(got, _fp32(_fp32(mma_dot(xq, wq, torch.zeros(5, 256, dtype=F64), tile) * xs) * ws))
    exact = xq @ wq.T * xs * ws
    assert not torch.equal(got, _fp32(exact))                          # the MMA's window is in it
    # each K tile's truncations stay within a few 2^-13 of its partial sums: 2^-11 of sum |a b| bounds them here
    assert ((got - exact).abs() <= 2.0 ** -11 * (xq.abs() @ wq.abs().T) * xs * ws).all()


def test_a_block_gemm_scales_each_128_block_and_adds_it_in_fp32():
    xq, xs, wq, ws = _operands("fp8_block")
    zero = torch.zeros(5, 256, dtype=F64)
    by_hand = zero
    for g, k0 in enumerate(range(0, 384, 128)):
        c = mma_dot(xq[:, k0:k0 + 128], wq[:, k0:k0 + 128], zero)
        col = ws[:, g].repeat_interleave(128)
        by_hand = _fp32(by_hand + _fp32(_fp32(c * xs[:, g:g + 1]) * col))
    assert torch.equal(scaled_gemm(xq, xs, wq, ws, "fp8_block", 128), by_hand)
    assert torch.equal(scaled_gemm(xq, xs, wq, ws, "fp8_block", None), by_hand)   # a block is one MMA chain
    assert not torch.equal(scaled_gemm(xq, xs, wq, ws, "fp8_block", 32), by_hand)


def test_chunks_of_rows_give_the_same_bits(monkeypatch):
    xq, xs, wq, ws = _operands("fp8_w8a8", M=7)
    whole = scaled_gemm(xq, xs, wq, ws, "fp8_w8a8", 128)
    monkeypatch.setattr(fp8_mma, "CHUNK_VALUES", 2 * 256 * STEP)       # two rows a step
    assert torch.equal(scaled_gemm(xq, xs, wq, ws, "fp8_w8a8", 128), whole)
    assert scaled_gemm(xq[:0], xs[:0], wq, ws, "fp8_w8a8", 128).shape == (0, 256)


def test_a_kernels_mma_declaration_is_checked():
    with pytest.raises(ValueError, match="tile must be a positive multiple of 32"):
        KernelMMA(48, (), ())
    assert KernelMMA(None, (), ()).tile is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="the rule is sm_90's e4m3 MMA (measured on an H100): needs such a GPU")
@pytest.mark.parametrize("imprecise", [-1, 128, 32], ids=["chained", "promoted-128", "promoted-32"])
def test_the_gpus_e4m3_dot_is_the_reference_bit_for_bit(imprecise):
    from moe_lora_harness.kernels.triton.e4m3_dot import e4m3_dot
    M = N = 64
    K = 512
    g = torch.Generator().manual_seed(11)
    a, b = ((torch.randn(M, K, generator=g, dtype=F64) * 16).to(torch.float8_e4m3fn) for _ in range(2))
    # the probe checked a chained dot from any C, a promoted one from C = 0
    c0 = ((torch.randn(M, N, generator=g, dtype=F64) * 64).to(torch.float32) if imprecise < 0
          else torch.zeros(M, N, dtype=torch.float32))
    got = e4m3_dot(a.cuda(), b.cuda(), c0.cuda(), 128, imprecise).cpu().to(F64)
    want = mma_dot(a.to(F64), b.to(F64), c0.to(F64), None if imprecise < 0 else imprecise)
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} results differ"
