"""Rule 4's statistic over the first-routing-weight slip with rows weighted by functions of that slot's weight."""
import sys, math, torch
from moe_lora_harness.backends import BUILTINS
from moe_lora_harness.harness.selftest import power
from moe_lora_harness.harness.served.models import model_named
from moe_lora_harness.harness.judge.expectation import Rules, row_groups, judge_twins
from moe_lora_harness.harness.judge import compare
from moe_lora_harness.harness.build.expert_runner import run_calls
from moe_lora_harness.harness.build.properties import plain_columns
F64 = torch.float64
spec = {b.name: b for b in BUILTINS}[sys.argv[1]]
T = int(sys.argv[2]); model = sys.argv[5] if len(sys.argv) > 5 else "qwen3-30b-a3b"
case = power.power_cases("cpu", layers=[model_named(model)], tokens=[T], dtypes=["float32"], ranks=[16])[0]
c = power.correct_run(spec, case, "cpu")
rules = Rules("cpu", c.points_only, row_groups(c.inputs, c.truth))
slip = [s for s in power.SLIPS if s.name == sys.argv[3]][0]
err = float((c.out.to(F64) - c.truth.value).norm())
w = c.inputs.topk_weights.to(F64).abs()
K = w.shape[1]
emu = c.emulation.value
written = torch.ones_like(c.truth.value, dtype=torch.bool)
z = compare.excess_sigmas(1 + K)
print("case", case.H, case.I, case.E, case.top_k, "z(1+K sets)", round(z, 2))
def stat(d, m):
    dm = d * m
    return compare.self_normalised(float(dm.sum()), float(dm.norm()), z)
for a in [float(x) for x in sys.argv[4].split(",")]:
    out = run_calls(spec, slip.make(c.inputs, a).call("cpu"), case)
    tw = plain_columns(run_calls(spec, slip.make(c.twin_inputs, a).call("cpu"), case))
    v = judge_twins(case, out, tw, c.truth, emu, c.precision, rules)
    d, al = compare.row_excess(out.to(F64), c.truth.value, emu, written, c.truth.acc_var, c.truth.round_var,
                               dtype=out.dtype, twin=tw)
    size = float((out.to(F64) - c.out.to(F64)).norm()) / err
    res = {name: stat(d, m) for name, m in (("1", torch.ones_like(d)), ("1/w", 1 / w[:, 0]), ("w", w[:, 0]),
           ("1/sqrt w", w[:, 0] ** -0.5), ("sqrt w", w[:, 0] ** 0.5), ("w/a", w[:, 0] / al), ("w^2/a", w[:, 0]**2 / al), ("1/a", 1/al))}
    print(f"alpha {a:.3g} size {size:.3g} judge ok {v.ok} ratio {v.ratio:.3g} excess {v.excess:.3g} | " +
          " ".join(f"{k}:{x:.3g}" for k, x in res.items()), flush=True)
