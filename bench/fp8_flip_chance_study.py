"""Study (forty-second session): rule 4 over FP8 rows, each GEMM2-input flip allowed its probability bound.

The truth carries `flip_sq` (reference.experts._flip_squares at this file's commit): per row, the sum over GEMM2's
input elements of a Chebyshev bound on the chance that a correct kernel's e4m3 code differs from the truth's, times
that flip's squared output change. This prints, on the CPU power case (eager, H 1024, I 512, E 8, top-2, rank 16),
the rows' squared error of the kernel and of the emulation, their squared difference, and the allowance's terms.
  usage: python bench/fp8_flip_chance_study.py [fp8_w8a8|fp8_block] [float16|bfloat16] [tokens]
"""
import sys

import torch

from moe_lora_harness.harness.judge import compare
from moe_lora_harness.harness.selftest import power
from moe_lora_harness.harness.spec.registry import available_backends

quant = sys.argv[1] if len(sys.argv) > 1 else "fp8_w8a8"
dt = sys.argv[2] if len(sys.argv) > 2 else "float16"
T = int(sys.argv[3]) if len(sys.argv) > 3 else 256
case = power.power_cases("cpu", tokens=(T,), dtypes=(dt,), ranks=(16,), quant=quant)[0]
c = power.correct_run(available_backends()["eager"], case, "cpu")
tr, emu, out = c.truth, c.emulation.value, c.out.to(torch.float64)
t = tr.value


def rows(x):
    return (x ** 2).sum(dim=1)


ke, ee = rows(out - t), rows(emu - t)
print(f"{quant} {dt} T{T}: squared error summed over rows: kernel {float(ke.sum()):.4g}, emulation "
      f"{float(ee.sum()):.4g}, kernel - emulation {float(rows(out - emu).sum()):.4g}")
print(f"  flip_sq (points only / other points) {float(tr.flip_sq[:, 0].sum()):.4g} / {float(tr.flip_sq[:, 1].sum()):.4g}; "
      f"slack^2 {float((tr.slack_flip ** 2).sum()):.4g}; 2 slack ||emu - truth|| {float((2 * tr.slack_flip * ee.sqrt()).sum()):.4g}; "
      f"ACC_SHARE acc_var {float((compare.ACC_SHARE * tr.acc_var).sum()):.3g}")
