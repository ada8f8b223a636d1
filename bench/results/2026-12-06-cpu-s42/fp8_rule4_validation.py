"""Validation: correct backends on random FP8 cases of 83-300 rows (rule 4 on, the twin where declared) on the CPU."""
import sys, random, time, torch
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.registry import available_backends
from moe_lora_harness.harness.execution.runner import run_case
from moe_lora_harness.harness.execution.execute import InProcess
backend = sys.argv[1]; n = int(sys.argv[2]); budget = float(sys.argv[3])
spec = available_backends()[backend]
rng = random.Random(int(sys.argv[4]) if len(sys.argv) > 4 else 0)
t0 = time.time(); counts = {}; fails = []
acts = ["silu", "gelu", "swigluoai", "relu2_no_mul"]
i = 0
while i < n and time.time() - t0 < budget:
    q = rng.choice(["fp8_w8a8", "fp8_block"])
    H = rng.choice([128, 256, 384]); I = rng.choice([128, 256])
    E = rng.choice([4, 8, 16]); k = rng.choice([1, 2, 4]); k = min(k, E)
    case = Case(level="expert", T=rng.randint(83, 300), H=H, I=I, E=E, top_k=k, max_loras=rng.choice([1, 2, 4]),
                max_rank=rng.choice([4, 8, 16]), mapping=rng.choice(["mixed", "all", "none"]) if False else "mixed",
                dtype=rng.choice(["float16", "bfloat16"]), seed=rng.randint(0, 10**6), quant=q,
                activation=rng.choice(acts), lora=rng.random() < 0.8)
    if case.problems():
        continue
    i += 1
    o = run_case(spec, case, "cpu", executor=InProcess(), reruns=0)
    counts[o.status] = counts.get(o.status, 0) + 1
    if o.status not in ("pass", "unsupported"):
        fails.append((case.to_json() if hasattr(case, "to_json") else repr(case), o.status, (o.message or "")[:300]))
print(backend, "cases", i, counts, "%.0fs" % (time.time() - t0))
for f in fails[:5]:
    print("FAIL", f)
