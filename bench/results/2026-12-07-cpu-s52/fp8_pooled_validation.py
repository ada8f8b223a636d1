"""Validation (fifty-second session): correct backends on random FP8 cases handed over in decode calls and judged
pooled (Case.call_tokens: calls of 1-16 tokens, 83-200 rows, so rule 4 and the twin judge them), as check --model
now judges an FP8 row's decode token counts. `python fp8_pooled_validation.py BACKEND N SECONDS SEED [DEVICE]`:
one line of counts, then any failure."""
import random
import sys
import time

from moe_lora_harness.harness.execution.execute import InProcess
from moe_lora_harness.harness.execution.runner import run_case
from moe_lora_harness.harness.spec.case import FP16_MASSIVE_MAGNITUDE, MASSIVE_OUTLIER_SCALE, Case
from moe_lora_harness.harness.spec.registry import available_backends

backend, n, budget = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
spec = available_backends()[backend]
rng = random.Random(int(sys.argv[4]) if len(sys.argv) > 4 else 0)
device = sys.argv[5] if len(sys.argv) > 5 else "cpu"
t0, counts, fails, i = time.time(), {}, [], 0
while i < n and time.time() - t0 < budget:
    per_call = rng.choice([1, 2, 3, 4, 7, 8, 16])
    calls = -(-rng.randint(83, 200) // per_call)
    dtype = rng.choice(["float16", "bfloat16"])
    kw = dict(outliers=1, outlier_scale=MASSIVE_OUTLIER_SCALE) if rng.random() < 0.5 else {}
    if kw and dtype == "float16":
        kw["magnitude"] = FP16_MASSIVE_MAGNITUDE
    E = rng.choice([4, 8, 16])
    case = Case(level="expert", T=per_call * calls, call_tokens=per_call, H=rng.choice([128, 256, 384]),
                I=rng.choice([128, 256]), E=E, top_k=min(rng.choice([1, 2, 4]), E), max_loras=rng.choice([1, 2, 4]),
                max_rank=rng.choice([4, 8, 16]), dtype=dtype, seed=rng.randint(0, 10 ** 6),
                quant=rng.choice(["fp8_w8a8", "fp8_block"]), mapping=rng.choice(["uniform", "mixed"]),
                activation=rng.choice(["silu", "gelu", "swigluoai", "relu2_no_mul"]), lora=rng.random() < 0.8, **kw)
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
