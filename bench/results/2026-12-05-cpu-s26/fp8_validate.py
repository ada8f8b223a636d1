"""Correct FP8 variants judged on random FP8 draws: eager, and eager quantizing by reciprocals (another scale
arithmetic): failures must be 0."""
import dataclasses, sys, time
import torch
from moe_lora_harness.harness.draw.strategies import fp8_cases, examples
from moe_lora_harness.harness.build.expert_runner import expert_expectations
from moe_lora_harness.harness.judge.expectation import allowances, judging, row_groups
from moe_lora_harness.harness.judge.compare import compare_written
from moe_lora_harness.harness.build.builders import torch_dtype
from moe_lora_harness.backends.eager import run_experts, BACKEND
from moe_lora_harness.kernels import eager_fp8
from moe_lora_harness.suites.experts.test_fp8 import _quantize_by_reciprocals

n, seed = int(sys.argv[1]), int(sys.argv[2])
cases = examples(fp8_cases(), n, seed=seed)
fails, worst, judged, t0 = [], 0.0, 0, time.time()
for c in cases:
    try:
        inp, truth, emu = expert_expectations(c, BACKEND.precision_for(c, "cpu"))
    except Exception as e:
        print("skip", c.to_json(), e); continue
    written, kpr, names = judging(c, truth)
    for variant in ("eager", "reciprocal"):
        call = inp.call("cpu")
        if variant == "eager":
            run_experts(call)
        else:
            run_experts(call, fp8_ops=dataclasses.replace(eager_fp8.FP8_OPS, quantize=_quantize_by_reciprocals))
        v = compare_written(call.output, truth.value, emu.value, truth.scale, written, dtype=torch_dtype(c),
                            k_plus_r=kpr, names=names, underflow=truth.underflow, work_dtype=torch_dtype(c),
                            row_groups=row_groups(inp, truth), model_points_only=BACKEND.model_points_only_for("cpu"),
                            **allowances(truth, "cpu"))
        judged += 1
        worst = max(worst, v.ratio)
        if not v.ok:
            fails.append((variant, c.to_json(), v.message[:200]))
print(f"seed {seed}: {judged} judgments of {len(cases)} cases, {len(fails)} failures, worst ratio {worst:.3g}, {time.time()-t0:.0f}s")
for f in fails[:10]:
    print(f)
