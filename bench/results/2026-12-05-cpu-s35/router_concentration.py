"""The first-routing-weight slip at Qwen3-30B-A3B's routing shape, fp32, 256 tokens (thirty-fifth session): how its square
spreads over the rows (the share the top tenth of rows holds), and rule 4's statistic with the twin and without it.
    python router_concentration.py eager 256 router-weight 1e-6,3e-6,1e-5,3e-5"""
import sys, math, torch, dataclasses
from moe_lora_harness.backends import BUILTINS
from moe_lora_harness.harness.selftest import power
from moe_lora_harness.harness.served.models import model_named
from moe_lora_harness.harness.judge.expectation import Rules, row_groups, judge_twins, judge_output
from moe_lora_harness.harness.judge import compare
from moe_lora_harness.harness.build.expert_runner import run_calls
from moe_lora_harness.harness.build.properties import plain_columns
F64 = torch.float64
spec = {b.name: b for b in BUILTINS}[sys.argv[1]]
T = int(sys.argv[2])
case = power.power_cases("cpu", layers=[model_named("qwen3-30b-a3b")], tokens=[T], dtypes=["float32"], ranks=[16])[0]
c = power.correct_run(spec, case, "cpu")
rules = Rules("cpu", c.points_only, row_groups(c.inputs, c.truth))
slip = [s for s in power.SLIPS if s.name == sys.argv[3]][0]
err = float((c.out.to(F64) - c.truth.value).norm())
w = c.inputs.topk_weights
print("w[:,0] stats", float(w[:,0].min()), float(w[:,0].median()), float(w[:,0].max()), "sorted?", bool((w[:, :-1] >= w[:, 1:]).all()))
for a in [float(x) for x in sys.argv[4].split(",")]:
    out = run_calls(spec, slip.make(c.inputs, a).call("cpu"), case)
    tw = plain_columns(run_calls(spec, slip.make(c.twin_inputs, a).call("cpu"), case))
    v = judge_twins(case, out, tw, c.truth, c.emulation.value, c.precision, rules)
    v0 = judge_output(case, out, c.truth, c.emulation.value, c.precision, rules)
    d = out.to(F64) - c.out.to(F64)
    rown = d.norm(dim=1)
    print(f"alpha {a:.4g} size {float(d.norm())/err:.3g} twin: ok {v.ok} ratio {v.ratio:.3g} excess {v.excess:.3g} | alone: ok {v0.ok} excess {v0.excess:.3g}; row sizes max/mean {float(rown.max()/rown.mean()):.2f} sum^2 share of top 10%: {float((rown**2).sort(descending=True).values[:T//10].sum()/(rown**2).sum()):.2f}")
