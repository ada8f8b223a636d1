"""A study, not a rule: what share of rule 4's accumulation allowance a correct kernel's fp32 accumulation uses.

Rule 4 allows `compare.ACC_SHARE` (a quarter) of the truth's `acc_var`, the bound for the fp32 accumulation's
expected square in any summation order independent of the values; a kernel that sums in blocks errs by less, and a
slip spread like the allowance then fails only past sqrt(ACC_SHARE / k - 1) times the kernel's own error, k the
kernel's share. This prints k for each backend at `selftest --power`'s cases (the default layer, or catalogued
models' layers): the floor under fp32's power at any token count without the twin run. Beside it, where the judge
runs a twin (the reordered view, compare.TWIN_FACTOR), the twins' squared difference over twice the kernel's excess
(q): the twin's allowance covers the kernel's accumulation while TWIN_FACTOR 2 q >= 1, and leaves a slip spread like
it the floor sqrt(2 q TWIN_FACTOR - 1). docs/error-model.md, "The twin run" and "What the judge cannot see".

    python bench/acc_share_study.py [--backend eager,triton_experts] [--device cpu] [--tokens 256,4096]
        [--model NAME ...] [--dtype float32] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from moe_lora_harness.backends import BUILTINS
from moe_lora_harness.harness.judge.compare import ACC_SHARE, TWIN_FACTOR
from moe_lora_harness.harness.selftest import power
from moe_lora_harness.harness.served.models import model_named

F64 = torch.float64


def share(spec, case, device: str) -> dict:
    """The correct kernel's squared error from the truth, the emulation's, and the kernel's excess over the
    emulation's as a share of sum acc_var (k), with the floor sqrt(ACC_SHARE / k - 1) it sets."""
    c = power.correct_run(spec, case, device)
    truth, emu = c.truth, c.emulation
    out = c.out.to(truth.value.device, F64)
    kernel = float(((out - truth.value) ** 2).sum())
    emulation = float(((emu.value - truth.value) ** 2).sum())
    acc = float(truth.acc_var.clamp_min(0).sum())
    k = (kernel - emulation) / acc if acc > 0 else math.nan
    q = math.nan
    if c.twin is not None and kernel > emulation:
        q = float(((out - c.twin.to(out.device, F64)) ** 2).sum()) / (2 * (kernel - emulation))
    return dict(backend=spec.name, case=case.to_json(), kernel_sq=kernel, emulation_sq=emulation, acc_var=acc,
                k=k, floor=math.sqrt(ACC_SHARE / k - 1) if 0 < k < ACC_SHARE else math.nan,
                twin_q=q, twin_floor=math.sqrt(2 * q * TWIN_FACTOR - 1) if 2 * q * TWIN_FACTOR > 1 else math.nan)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="eager,triton_experts")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", default="256")
    ap.add_argument("--model", action="append", default=[])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    specs = {b.name: b for b in BUILTINS}
    cases = power.power_cases(a.device, layers=[model_named(m) for m in a.model],
                              tokens=[int(t) for t in a.tokens.split(",")], dtypes=a.dtype.split(","))
    rows = []
    for case in cases:
        for name in a.backend.split(","):
            r = share(specs[name], case, a.device)
            rows.append(r)
            print(f"{name:16s} {case.dtype} T{case.T} H{case.H} I{case.I} E{case.E} k{case.top_k}: kernel^2 "
                  f"{r['kernel_sq']:.3e}, emulation^2 {r['emulation_sq']:.3e}, k = {r['k']:.4f} of acc_var, floor "
                  f"sqrt({ACC_SHARE}/k - 1) = {r['floor']:.2f}; twin q = {r['twin_q']:.3f} (covered: "
                  f"{TWIN_FACTOR} * 2q = {2 * TWIN_FACTOR * r['twin_q']:.2f} >= 1), floor {r['twin_floor']:.2f}",
                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
