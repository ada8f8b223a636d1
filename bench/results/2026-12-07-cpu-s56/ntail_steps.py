"""The w2-expand-n-tail slip on the CPU's pooled FP8 power case: each alpha's verdict, to see which rule holds it."""
import sys, torch
from moe_lora_harness.harness.selftest import power as P
from moe_lora_harness.harness.judge.expectation import Rules, row_groups, judge_twins
from moe_lora_harness.harness.spec.registry import available_backends
quant, dt = sys.argv[1], sys.argv[2]
spec = available_backends()["eager"]
case = P.power_cases("cpu", tokens=(16,), dtypes=(dt,), ranks=(16,), quant=quant, calls=21)[0]
c = P.correct_run(spec, case, "cpu")
rules = Rules("cpu", c.points_only, row_groups(c.inputs, c.truth), mma=c.mma)
run = P.runner(spec, case, "cpu")
judge = lambda out, twin=None: judge_twins(case, out, twin, c.truth, c.emulation.value, c.precision, rules,
                                           c.twin_emulation, c.twin_truth)
slip = next(s for s in P.SLIPS if s.name == "w2-expand-n-tail")
ref = float(torch.linalg.vector_norm(c.out.double() - c.truth.value))
print("twin", c.twin is not None, "correct:", judge(c.out, c.twin).summary())
for a in [float(x) for x in sys.argv[3:]]:
    out = run(slip.make(c.inputs, a))
    tw = None if c.twin_inputs is None else P.twin_columns(run(slip.make(c.twin_inputs, a)), case)
    d = out.double() - c.out.double()
    cols = (d != 0).reshape(-1, d.shape[-1]).any(0).nonzero().flatten()
    v = judge(out, tw)
    print(f"alpha {a}: size {float(torch.linalg.vector_norm(d))/ref:.3f} cols {cols.min().item() if len(cols) else None}-{cols.max().item() if len(cols) else None} ({len(cols)}) ok {v.ok} kind {v.kind} ratio {v.ratio:.3f} excess {v.excess:.3f}")
    print("   ", v.message[:600].replace("\n", " | "))
