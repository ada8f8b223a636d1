"""Validation (forty-seventh session, short sums and few sources): correct backends on random fp32 cases of 83-300
rows with tiny sums (H, I, K 1-40) and low ranks (1-4), where a twin's two orders sum alike (two terms commute) or a
row's error has few sources (an op row's rank values), the cases the fuzz found a false verdict in. `python twin_rule3_validation.py REF|NAME N SECONDS SEED [DEVICE] [LEVEL]`,
LEVEL expert (one rank, decode calls, TP, dispatched EP) or op: one line of counts (and how many cases ran a twin),
then any failure with its case."""
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
level = sys.argv[6] if len(sys.argv) > 6 else "expert"
ACTS = ["silu", "silu", "gelu", "swigluoai", "relu2_no_mul", "silu_no_mul"]
BIG = device != "cpu"     # a GPU: served sizes too


def rows():
    return rng.randint(83, 300)


def dims():
    return (rng.choice([rng.randint(1, 8), rng.randint(9, 40), rng.randint(64, 160)]),
            rng.choice([rng.randint(1, 8), rng.randint(9, 40), rng.randint(64, 160)]))


def op_case():
    E, ep, slices, fs = rng.choice([4, 8, 16]), rng.choice([1, 1, 1, 2]), rng.choice([1, 2, 3]), rng.random() < 0.2
    H, I = dims()
    return Case(level="op", T=rows(), H=H, I=I, E=E, top_k=min(rng.choice([1, 2, 4]), E), dtype="float32",
                max_loras=rng.choice([1, 2, 4]), max_rank=rng.choice([1, 2, 3, 4, 16]), mapping=rng.choice(MAPPINGS),
                which=rng.choice(["w13", "w2"]), num_slices=slices, mul_routed_weight=rng.random() < 0.3,
                add_inputs=fs or rng.random() < 0.7, layout=rng.choice(["sorted", "sorted", "naive"]),
                block_size_m=rng.choice([16, 32, 64]), fully_sharded=fs, shared_a=rng.random() < 0.15,
                shared_b=rng.random() < 0.15, ep_size=ep, ep_rank=rng.randrange(ep),
                magnitude=rng.choice([1.0, 1.0, 2.0 ** -6, 64.0]), seed=rng.randint(0, 10 ** 6))


def expert_case():
    T, E = rows(), rng.choice([4, 8, 16])
    H, I = dims()
    kw = dict(level="expert", T=T, H=H, I=I, E=E, top_k=min(rng.choice([1, 2, 4]), E), dtype="float32",
              max_loras=rng.choice([1, 2, 4]), max_rank=rng.choice([1, 2, 3, 4, 16]), mapping=rng.choice(MAPPINGS),
              activation=rng.choice(ACTS), bias=rng.random() < 0.3, shared_a=rng.random() < 0.15,
              shared_b=rng.random() < 0.15, magnitude=rng.choice([1.0, 1.0, 2.0 ** -6, 64.0]),
              lora=rng.random() < 0.9, seed=rng.randint(0, 10 ** 6))
    u = rng.random()
    if u < 0.3:
        kw.update(tp_size=rng.choice([2, 2, 4]), fully_sharded=rng.random() < 0.5)
    elif u < 0.45:
        ep = rng.choice([2, 2, 4])
        cuts = sorted(rng.randint(0, T) for _ in range(ep - 1))
        kw.update(ep_size=ep, ep_tokens=tuple(b - a for a, b in zip([0, *cuts], [*cuts, T])))
    elif u < 0.6:
        ct = rng.choice([1, 2, 4, 8])
        kw.update(T=max(T // ct, 1) * ct, call_tokens=ct)
    return Case(**kw)


for spec in specs:
    t0 = time.time()
    counts, fails, twins, i = {}, [], 0, 0
    while i < n and time.time() - t0 < budget:
        case = op_case() if level == "op" else expert_case()
        if case.problems():
            continue
        i += 1
        twins += twin_applies(case)
        o = run_case(spec, case, device, executor=InProcess(), reruns=0)
        key = f"xfail:{o.kind}" if o.status == "xfail" else o.status     # what the ledger's entry was given
        counts[key] = counts.get(key, 0) + 1
        if o.status not in ("pass", "unsupported", "xfail", "not-runnable"):
            fails.append((case.to_json(), o.status, (o.message or o.reason or "")[:400]))
    print(spec.name, device, level, "cases", i, "twinned", twins, counts, "%.0fs" % (time.time() - t0), flush=True)
    for f in fails[:8]:
        print("FAIL", f, flush=True)
