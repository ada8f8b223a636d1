"""Which rule fails the w2-expand-n-tail slip, and each rule-4 set's statistic (debug)."""
import sys, math, torch
from moe_lora_harness.harness.judge import compare
from moe_lora_harness.harness.selftest import power
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.judge.expectation import Rules, judge_twins, row_groups
from moe_lora_harness.harness.build.properties import plain_columns
from moe_lora_harness.harness.build.expert_runner import run_calls
from moe_lora_harness.backends.eager import BACKEND as EAGER
quant, dtype, slipname = sys.argv[1], sys.argv[2], sys.argv[3]
alphas = [float(a) for a in sys.argv[4].split(",")]
case = Case.from_json('{"E":8,"H":1024,"I":512,"T":256,"level":"expert","max_rank":16,"quant":"%s","dtype":"%s"}' % (quant, dtype))
c = power.correct_run(EAGER, case)
rules = Rules("cpu", c.points_only, row_groups(c.inputs, c.truth), mma=c.mma)
rec = []
orig = compare.self_normalised
def sn(t, sp, z):
    r = orig(t, sp, z); rec.append((r, t, sp, z)); return r
compare.self_normalised = sn
slip = {s.name: s for s in power.SLIPS}[slipname]
ref = float(torch.linalg.vector_norm(c.out.double() - c.truth.value))
for a in alphas:
    out = run_calls(EAGER, slip.make(c.inputs, a).call("cpu"), case)
    tw = plain_columns(run_calls(EAGER, slip.make(c.twin_inputs, a).call("cpu"), case), case.quant) if c.twin_inputs is not None else None
    rec.clear()
    v = judge_twins(case, out, tw, c.truth, c.emulation.value, c.precision, rules, c.twin_emulation)
    size = float(torch.linalg.vector_norm(out.double() - c.out.double())) / ref
    first = rec[: len(rec) // 2] if tw is not None and v.ok else rec
    top = sorted(range(len(first)), key=lambda i: -first[i][0])[:4]
    print(f"alpha {a:.4g} size {size:.3g} ok={v.ok} kind={v.kind} ratio={v.ratio:.3g} ulps={v.max_ulps:.3g} excess={v.excess:.3g} nsets={len(first)}")
    print("   set0 (every row):", tuple(round(x, 4) for x in first[0]), " top:", [(i, round(first[i][0], 3)) for i in top])
    if not v.ok: print("   ", v.message[:300])
