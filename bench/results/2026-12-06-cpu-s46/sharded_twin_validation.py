"""Validation (forty-sixth session): correct expert backends (ours, and vLLM 0.33.0's expert classes wrapped as users
wrap them) on random fp32 TP and dispatched-EP cases through the runner, which now runs the twin (the reordered view;
under TP each rank's shard of H and I permuted within) on those of 83 rows or more.
`python sharded_twin_validation.py REF|NAME N SECONDS SEED [DEVICE]`: one line of counts (and how many cases ran a
twin), then any failure with its case."""
import random
import sys
import time

from moe_lora_harness.harness.execution.execute import InProcess
from moe_lora_harness.harness.execution.runner import run_case
from moe_lora_harness.harness.judge.expectation import twin_applies
from moe_lora_harness.harness.spec.case import MAPPINGS, Case
from moe_lora_harness.harness.spec.registry import available_backends, load_ref

ref, n, budget = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
specs = load_ref(ref) if ":" in ref else [available_backends()[ref]]
rng = random.Random(int(sys.argv[4]) if len(sys.argv) > 4 else 0)
device = sys.argv[5] if len(sys.argv) > 5 else "cpu"
ACTS = ["silu", "silu", "gelu", "swigluoai", "relu2_no_mul", "silu_no_mul"]
for spec in specs:
    t0 = time.time()
    counts, fails, twins, i = {}, [], 0, 0
    while i < n and time.time() - t0 < budget:
        T = rng.choice([rng.randint(83, 300), rng.randint(83, 140), rng.randint(2, 82)])
        E = rng.choice([4, 8, 16])
        kw = dict(level="expert", T=T, H=rng.choice([64, 128, 192, 256]), I=rng.choice([64, 96, 128, 192]), E=E,
                  top_k=min(rng.choice([1, 2, 4]), E), dtype="float32", max_loras=rng.choice([1, 2, 4]),
                  max_rank=rng.choice([4, 8, 16, 32]), mapping=rng.choice(MAPPINGS),
                  activation=rng.choice(ACTS), bias=rng.random() < 0.3, shared_a=rng.random() < 0.15,
                  shared_b=rng.random() < 0.15, magnitude=rng.choice([1.0, 1.0, 2.0 ** -6, 64.0]),
                  lora=rng.random() < 0.9, seed=rng.randint(0, 10 ** 6))
        if rng.random() < 0.6:
            kw.update(tp_size=rng.choice([2, 2, 4]), fully_sharded=rng.random() < 0.5)
        else:
            ep = rng.choice([2, 2, 4])
            cuts = sorted(rng.randint(0, T) for _ in range(ep - 1))
            kw.update(ep_size=ep, ep_tokens=tuple(b - a for a, b in zip([0, *cuts], [*cuts, T])))
        case = Case(**kw)
        if case.problems():
            continue
        i += 1
        twins += twin_applies(case)
        o = run_case(spec, case, device, executor=InProcess(), reruns=0)
        key = f"xfail:{o.kind}" if o.status == "xfail" else o.status     # what the ledger's entry was given
        counts[key] = counts.get(key, 0) + 1
        if o.status not in ("pass", "unsupported", "xfail", "not-runnable"):
            fails.append((case.to_json(), o.status, (o.message or o.reason or "")[:400]))
    print(spec.name, device, "cases", i, "twinned", twins, counts, "%.0fs" % (time.time() - t0), flush=True)
    for f in fails[:8]:
        print("FAIL", f, flush=True)
