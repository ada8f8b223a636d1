"""One 16-token FP8 call judged alone (rule 3 only): each row's error beside the flip floor rule 3 holds it to.
The fifty-fifth session's measure of why such a call's slips pass up to 4.8 times the kernel's error
(docs/error-model.md, "What the judge cannot see", item 3).

    python bench/results/2026-12-07-cpu-s55/fp8_row_floor.py [--quant fp8_block|fp8_w8a8] [--dtype float16|bfloat16]
"""
import argparse
import math

import torch

from moe_lora_harness.harness.selftest.power import correct_run, power_cases
from moe_lora_harness.harness.spec.registry import available_backends

ap = argparse.ArgumentParser()
ap.add_argument("--quant", default="fp8_block")
ap.add_argument("--dtype", default="float16")
a = ap.parse_args()
case = power_cases("cpu", tokens=(16,), dtypes=(a.dtype,), ranks=(16,), quant=a.quant)[0]
r = correct_run(available_backends()["eager"], case, "cpu")
truth, emu, out = r.truth.value, r.emulation.value.double(), r.out.double().cpu()
print(f"{a.quant} {a.dtype} T16 H1024 I512 E8 k2 r16, eager (declared to round at its model's points)")
print("whole tensor: kernel error %.4g, emulation's %.4g, max one_flip %.4g, half a spacing of the truth %.4g, "
      "accumulation term %.3g" % ((out - truth).norm(), (emu - truth).norm(), r.truth.one_flip.max(),
                                  0.5 * torch.finfo(getattr(torch, a.dtype)).eps * truth.norm(),
                                  1.2 * math.sqrt(float(r.truth.acc_var.clamp_min(0).sum()))))
print("row  kernel-err  emu-err  |out-emu|  one_flip  one_flip/kernel-err")
for i, (k, e, d, f) in enumerate(zip((out - truth).norm(dim=1), (emu - truth).norm(dim=1), (out - emu).norm(dim=1),
                                     r.truth.one_flip.double())):
    print("%3d  %10.4f  %7.4f  %9.4f  %8.4f  %6.1f" % (i, k, e, d, f, f / k))
