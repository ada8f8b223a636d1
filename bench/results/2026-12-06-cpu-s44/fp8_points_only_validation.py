"""Validation (forty-fourth session): correct backends declared to round at their model's points on random FP8 cases
of 1-300 rows through the runner, rule 3's floors without the scale arithmetic's flips (slack_flip) for such a
backend. `python fp8_points_only_validation.py BACKEND N SECONDS SEED [DEVICE]`: one line of counts, then any
failure."""
import sys, random, time
from moe_lora_harness.harness.spec.case import Case, MASSIVE_OUTLIER_SCALE, FP16_MASSIVE_MAGNITUDE
from moe_lora_harness.harness.spec.registry import available_backends
from moe_lora_harness.harness.execution.runner import run_case
from moe_lora_harness.harness.execution.execute import InProcess
backend = sys.argv[1]; n = int(sys.argv[2]); budget = float(sys.argv[3])
spec = available_backends()[backend]
rng = random.Random(int(sys.argv[4]) if len(sys.argv) > 4 else 0)
device = sys.argv[5] if len(sys.argv) > 5 else "cpu"
t0 = time.time(); counts = {}; fails = []
acts = ["silu", "gelu", "swigluoai", "relu2_no_mul"]
i = 0
while i < n and time.time() - t0 < budget:
    q = rng.choice(["fp8_w8a8", "fp8_block"])
    H = rng.choice([128, 256, 384]); I = rng.choice([128, 256])
    E = rng.choice([4, 8, 16]); k = min(rng.choice([1, 2, 4]), E)
    dtype = rng.choice(["float16", "bfloat16"])
    T = rng.choice([rng.randint(1, 16), rng.randint(17, 82), rng.randint(83, 300)])
    massive = rng.random() < 0.5
    kw = dict(outliers=1, outlier_scale=MASSIVE_OUTLIER_SCALE) if massive and T > 1 else {}
    if kw and dtype == "float16":
        kw["magnitude"] = FP16_MASSIVE_MAGNITUDE
    case = Case(level="expert", T=T, H=H, I=I, E=E, top_k=k, max_loras=rng.choice([1, 2, 4]),
                max_rank=rng.choice([4, 8, 16]), dtype=dtype, seed=rng.randint(0, 10**6), quant=q,
                activation=rng.choice(acts), lora=rng.random() < 0.8, **kw)
    if case.problems():
        continue
    i += 1
    o = run_case(spec, case, device, executor=InProcess(), reruns=0)
    counts[o.status] = counts.get(o.status, 0) + 1
    if o.status not in ("pass", "unsupported"):
        fails.append((case.to_json(), o.status, (o.message or "")[:400]))
print(backend, device, "cases", i, counts, "%.0fs" % (time.time() - t0))
for f in fails[:8]:
    print("FAIL", f)
