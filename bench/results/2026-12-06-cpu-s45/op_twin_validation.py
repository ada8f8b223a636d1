"""Validation (forty-fifth session): correct op-level backends (ours, and third parties wrapped as users wrap them) on
random fp32 op cases through the runner, which now runs the twin (the reordered view: K permuted through x and every
LoRA A) on those of 83 rows or more. `python op_twin_validation.py REF|NAME N SECONDS SEED [DEVICE]`: one line of
counts (and how many cases ran a twin), then any failure with its case."""
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
for spec in specs:
    t0 = time.time()
    counts, fails, twins, i = {}, [], 0, 0
    while i < n and time.time() - t0 < budget:
        E = rng.choice([4, 8, 16])
        ep = rng.choice([1, 1, 1, 2])
        slices = rng.choice([1, 2, 3])
        fs = rng.random() < 0.2
        kw = dict(level="op", T=rng.choice([rng.randint(83, 300), rng.randint(83, 140), rng.randint(2, 82)]),
                  H=rng.choice([64, 128, 192, 256]), I=rng.choice([64, 96, 128]), E=E,
                  top_k=min(rng.choice([1, 2, 4]), E), dtype="float32", max_loras=rng.choice([1, 2, 4]),
                  max_rank=rng.choice([4, 8, 16, 32]), mapping=rng.choice(MAPPINGS), which=rng.choice(["w13", "w2"]),
                  num_slices=slices, mul_routed_weight=rng.random() < 0.3, add_inputs=fs or rng.random() < 0.7,
                  layout=rng.choice(["sorted", "sorted", "naive"]), block_size_m=rng.choice([16, 32, 64]),
                  fully_sharded=fs, shared_a=rng.random() < 0.15, shared_b=rng.random() < 0.15,
                  ep_size=ep, ep_rank=rng.randrange(ep), magnitude=rng.choice([1.0, 1.0, 2.0 ** -6, 64.0]),
                  seed=rng.randint(0, 10 ** 6))
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
