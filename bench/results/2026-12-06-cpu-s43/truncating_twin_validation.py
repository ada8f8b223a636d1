"""Validation of rule 4 under a truncating e4m3 MMA with each twin against its own emulation, on the CPU: random FP8
cases of 83-300 rows; a correct backend's run and its twin (the reordered view), each moved from its exact sums'
emulation onto the MMA's emulation of its own order (the MMA promoted every 128: what the H100's warpgroup MMA runs for
our experts' row tiles of 64), judged as the runner judges them there (device "cuda:0", mma 128, the backend's
model_points_only). Prints the verdicts, how often rule 4 judged, and the first failures.
    usage: python truncating_twin_validation.py BACKEND N BUDGET_S [SEED]"""
import random
import sys
import time

import torch

from moe_lora_harness.harness.build.expert_runner import expert_expectations
from moe_lora_harness.harness.build.properties import plain_columns
from moe_lora_harness.harness.judge import compare
from moe_lora_harness.harness.judge.expectation import Rules, judge_twins, row_groups
from moe_lora_harness.harness.selftest import power
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.contract import support_for
from moe_lora_harness.harness.spec.registry import available_backends

F64 = torch.float64
backend, n, budget = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
spec = available_backends()[backend]
rng = random.Random(int(sys.argv[4]) if len(sys.argv) > 4 else 0)
t0, counts, fails, rule4, i = time.time(), {}, [], 0, 0
while i < n and time.time() - t0 < budget:
    q = rng.choice(["fp8_w8a8", "fp8_block"])
    case = Case(level="expert", T=rng.randint(83, 300), H=rng.choice([128, 256, 384]), I=rng.choice([128, 256]),
                E=rng.choice([4, 8, 16]), top_k=rng.choice([1, 2, 4]), max_loras=rng.choice([1, 2, 4]),
                max_rank=rng.choice([4, 8, 16]), mapping="mixed", dtype=rng.choice(["float16", "bfloat16"]),
                seed=rng.randint(0, 10**6), quant=q, activation=rng.choice(["silu", "gelu", "swigluoai", "relu2_no_mul"]),
                lora=rng.random() < 0.8)
    if case.problems() or not support_for(spec, case, "cpu")[0]:
        counts["unsupported or malformed"] = counts.get("unsupported or malformed", 0) + 1
        continue
    i += 1
    c = power.correct_run(spec, case, "cpu")
    if c.twin is None:
        counts["no twin"] = counts.get("no twin", 0) + 1
        continue

    def emulation(inputs, mma, view=""):
        e = expert_expectations(case.replace(view=view), c.precision, emulation_only=True, inputs=inputs, mma=mma)[2]
        return plain_columns(e.value, q) if view else e.value
    on_mma, twin_on_mma = emulation(c.inputs, 128), emulation(c.twin_inputs, 128, "reordered")
    out = (on_mma + (c.out.to(F64) - c.emulation.value)).to(c.out.dtype)
    twin = (twin_on_mma + (c.twin.to(F64) - emulation(c.twin_inputs, None, "reordered"))).to(c.out.dtype)
    v = judge_twins(case, out, twin, c.truth, on_mma, c.precision,
                    Rules("cuda:0", c.points_only, row_groups(c.inputs, c.truth), mma=128), twin_on_mma)
    key = "pass" if v.ok else "FAIL"
    counts[key] = counts.get(key, 0) + 1
    rule4 += v.unseen != compare.RULE4_OFF
    if not v.ok:
        fails.append((case.to_json(), v.message[:300]))
print(backend, "cases", i, counts, "rule 4 judged", rule4, "%.0fs" % (time.time() - t0))
for f in fails[:5]:
    print("FAIL", f)
