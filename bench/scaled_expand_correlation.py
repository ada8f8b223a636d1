"""The op-level twin's scaled LoRA B (harness.build.properties.OP_TWIN_B_SCALE), measured: an fp32 expand over the
rank, out = u @ B^T summed by torch, against the same with B times the scale (rounded to fp32), each less its exact
float64 value; the correlation of the two errors (the twin's model needs it under TWIN_RHO = 2/3) and the ratio of
their variances (the twin's at least the plain run's keeps its measure conservative: docs/error-model.md, "The op's
expand, measured"). B drawn in fp32, and in bf16's precision as a real adapter file holds it.
    python bench/scaled_expand_correlation.py [rows] [cols]
"""
import sys

import torch

from moe_lora_harness.harness.build.properties import OP_TWIN_B_SCALE


def study(R: int, bf16_b: bool, rows: int, cols: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed + R)
    u = torch.randn(rows, R, generator=g)
    b = torch.randn(cols, R, generator=g) / R ** 0.5
    if bf16_b:
        b = b.to(torch.bfloat16).float()
    b2 = (b * OP_TWIN_B_SCALE).float()
    a = (u @ b.T).double() - u.double() @ b.double().T
    e = (u @ b2.T).double() - u.double() @ b2.double().T
    e = e / OP_TWIN_B_SCALE              # in the plain run's units (for the correlation and the variance ratio)
    live = (a != 0) | (e != 0)
    a, e = a[live], e[live]
    rho = float((a * e).mean() / ((a * a).mean() * (e * e).mean()).sqrt())
    ratio = float((e * e).mean() * OP_TWIN_B_SCALE ** 2 / (a * a).mean())
    same = float((a == e).double().mean())
    return rho, ratio, same


def main():
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    cols = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    print(f"scale {OP_TWIN_B_SCALE!r}; errors of fp32 u @ B^T ({rows} x R) @ (R x {cols}) and of the scaled B")
    print("R    B          corr   var(twin)/var(plain)  equal errors")
    for bf16_b in (False, True):
        for R in (1, 2, 4, 8, 16, 32, 64):
            rho, ratio, same = study(R, bf16_b, rows, cols)
            kind = "bf16-valued" if bf16_b else "fp32"
            print(f"{R:<4} {kind:<10} {rho:+.3f}  {ratio:.3f}{'':17}{same:.3f}")


if __name__ == "__main__":
    main()
