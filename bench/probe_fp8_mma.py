"""Measure how a GPU's e4m3 tensor-core dot accumulates (an instrument for the error model, not a test).

Two measurements, both on tl.dot over float8_e4m3fn tiles (M = N = 64) with an fp32 accumulator:
  bits    a sum 1 + 2^-j (j = 0..18) in one K = 32 dot: the smallest 2^-j that still reaches the result says how
          many bits below the largest term the accumulation keeps (an IEEE fp32 sum keeps 23);
  random  e4m3 values of random sign and magnitude, K = 128 .. 7168, accumulated three ways: one chained dot
          (Triton's sm_90 default: no promotion), promoted to fp32 every 128 (max_num_imprecise_acc = 128, our
          fp8_w8a8 GEMM), every 32; the error against the float64 sum in units of 2^-24 * sum|a b| (the size an
          IEEE fp32 accumulation's per-step rounding takes) and relative to the largest |result|.

  PYTHONPATH=src python bench/probe_fp8_mma.py --out probe.json
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
import triton

from moe_lora_harness.kernels.triton.e4m3_dot import e4m3_dot

M = N = 64


def dot(a, b, acc0, block_k: int, imprecise: int) -> torch.Tensor:
    c = e4m3_dot(a, b, acc0, block_k, imprecise)
    torch.cuda.synchronize()
    return c


def bits(block_k: int = 32) -> list:
    """Row r: 1 * 1 + 2^-(r % 10) * 2^-(n % 10) for column n (products 2^0 .. 2^-18), starting from acc0 = 0 and
    from acc0 = 2^8 (a large running sum); which small products reach the fp32 result."""
    a = torch.zeros(M, block_k, dtype=torch.float64)
    b = torch.zeros(N, block_k, dtype=torch.float64)
    a[:, 0], b[:, 0] = 1.0, 1.0
    a[:, 1] = 2.0 ** -(torch.arange(M) % 10).double()
    b[:, 1] = 2.0 ** -(torch.arange(N) % 10).double()
    a8, b8 = (t.to(torch.float8_e4m3fn).cuda() for t in (a, b))
    out = []
    for acc0 in (0.0, 256.0):
        for imprecise in (-1, 0):
            c = dot(a8, b8, torch.full((M, N), acc0, device="cuda"), block_k, imprecise).double().cpu()
            exact = acc0 + a @ b.t()
            small = a[:, 1:2] * b[:, 1].unsqueeze(0)
            kept = (c - acc0 - 1.0) / small          # 1: the small product survived, 0: lost
            js = -torch.log2(small).round().long()
            by_j = {int(j): float(kept[js == j].mean()) for j in torch.unique(js)}
            out.append(dict(test="bits", acc0=acc0, imprecise=imprecise, exact=bool(torch.equal(c, exact)),
                            kept_fraction_by_j=by_j))
    return out


def random_errors(Ks=(128, 1024, 4096, 7168), seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for K in Ks:
        a = (torch.randn(M, K, generator=g, dtype=torch.float64) * 16).to(torch.float8_e4m3fn)
        b = (torch.randn(N, K, generator=g, dtype=torch.float64) * 16).to(torch.float8_e4m3fn)
        ad, bd = a.double(), b.double()
        exact = ad @ bd.t()
        mag = ad.abs() @ bd.abs().t()
        for imprecise in (-1, 128, 32):
            c = dot(a.cuda(), b.cuda(), torch.zeros(M, N, device="cuda"), 128, imprecise).double().cpu()
            err = (c - exact).abs()
            out.append(dict(test="random", K=K, imprecise=imprecise,
                            max_err_in_2m24_sum_abs=float((err / (mag * 2.0 ** -24)).max()),
                            median_err_in_2m24_sum_abs=float((err / (mag * 2.0 ** -24)).median()),
                            max_err_rel_to_max_result=float(err.max() / exact.abs().max()),
                            mean_signed_err_rel=float(((c - exact) / mag).mean())))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_fp8_mma: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = bits() + random_errors()
    for r in rows:
        print(json.dumps(r), flush=True)
    meta = dict(device=torch.cuda.get_device_name(), capability=torch.cuda.get_device_capability(),
                torch=torch.__version__, triton=triton.__version__)
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
