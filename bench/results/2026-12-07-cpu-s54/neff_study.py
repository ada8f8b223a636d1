import torch, math, sys
from moe_lora_harness.harness.selftest import power
from moe_lora_harness.backends.eager import BACKEND as EAGER
from moe_lora_harness.harness.judge import compare
from moe_lora_harness.harness.judge.expectation import Rules, row_groups, allowances
F64=torch.float64
quant = sys.argv[1]; T = int(sys.argv[2]); calls = int(sys.argv[3]); names = sys.argv[4].split(",")
case = power.power_cases("cpu", tokens=(T,), dtypes=("float16",), ranks=(16,), quant=quant, calls=calls)[0]
c = power.correct_run(EAGER, case, "cpu")
run = power.runner(EAGER, case, "cpu")
own = float(torch.linalg.vector_norm(c.out.to(F64) - c.truth.value))
al = allowances(c.truth, "cpu", c.mma, c.twin is not None, c.points_only)
w = torch.ones_like(c.truth.value, dtype=torch.bool)
d0, A = compare.row_excess(c.out.to(F64), c.truth.value, c.emulation.value, w, al["acc_var"], al["round_var"], dtype=torch.float16,
     underflow=c.truth.underflow, model_points_only=c.points_only, twin=c.twin, flips=None if al["flip_sq"] is None else (al["flip_sq"], al["slack_flip"]))
print("rows", case.T, "A range", float(A.min()), float(A.max()), "D0/A", float((d0/A).min()), float((d0/A).max()))
for name in names:
    slip = [s for s in power.SLIPS if s.name == name][0]
    for alpha in (1e-3, 1e-2, 0.1):
        out = run(slip.make(c.inputs, alpha))
        diff = out.to(F64) - c.out.to(F64)
        s = diff.pow(2).sum(1)
        ne = lambda x: float(x.sum() ** 2 / (x * x).sum())
        twin = None if c.twin_inputs is None else power.twin_columns(run(slip.make(c.twin_inputs, alpha)), case)
        d, _ = compare.row_excess(out.to(F64), c.truth.value, c.emulation.value, w, al["acc_var"], al["round_var"], dtype=torch.float16,
            underflow=c.truth.underflow, model_points_only=c.points_only, twin=twin, flips=None if al["flip_sq"] is None else (al["flip_sq"], al["slack_flip"]))
        z = compare.EXCESS_SIGMAS
        st = lambda x: float(x.sum() / (z * x.norm()))
        print(f"{name} alpha {alpha:g} size {float(diff.norm())/own:.3g} neff raw {ne(s):.1f} /A {ne(s/A):.1f} /sqrtA {ne(s/A.sqrt()):.1f}  stat plain {st(d):.3g} /A {st(d/A):.3g} /sqrtA {st(d/A.sqrt()):.3g}")
