import sys, math, torch
from moe_lora_harness.harness.judge import compare
from moe_lora_harness.harness.selftest import power
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.judge.expectation import Rules, judge_output, row_groups, held_to
import dataclasses
from moe_lora_harness.harness.build.properties import plain_columns
from moe_lora_harness.harness.build.expert_runner import run_calls
from moe_lora_harness.backends.eager import BACKEND as EAGER
quant, dtype, slipname, a = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
case = Case.from_json('{"E":8,"H":1024,"I":512,"T":256,"level":"expert","max_rank":16,"quant":"%s","dtype":"%s"}' % (quant, dtype))
c = power.correct_run(EAGER, case)
rules = Rules("cpu", c.points_only, row_groups(c.inputs, c.truth), mma=c.mma)
cap = {}
orig = compare.row_excess
def rx(*args, **kw):
    r = orig(*args, **kw)
    if kw.get("blocks"): cap["d"], cap["a"] = r
    return r
compare.row_excess = rx
slip = {s.name: s for s in power.SLIPS}[slipname]
def go(out, tw):
    own = c.emulation.value if c.twin_emulation is None else c.twin_emulation
    v = judge_output(case, out, c.truth, c.emulation.value, c.precision, dataclasses.replace(rules, twin=held_to(tw, own, c.emulation.value)))
    return v, cap["d"].clone(), cap["a"].clone()
v0, d0, a0 = go(c.out, c.twin)
out = run_calls(EAGER, slip.make(c.inputs, a).call("cpu"), case)
tw = plain_columns(run_calls(EAGER, slip.make(c.twin_inputs, a).call("cpu"), case), case.quant)
v1, d1, a1 = go(out, tw)
s2 = ((out.double() - c.out.double()) ** 2)
e0 = ((c.out.double() - c.truth.value) ** 2); em = ((c.emulation.value - c.truth.value) ** 2)
blocks = compare.column_blocks(case.H)
for name, col in (("row", 0), ("last64", 1 + 15), ("last128", 1 + 16 + 7)):
    sl = slice(None) if col == 0 else slice(*blocks[col - 1])
    sig = s2[:, sl].sum(1)
    neff = float(sig.sum() ** 2 / (sig ** 2).sum())
    print(f"{name}: signal {float(sig.sum()):.3g} neff {neff:.1f} | correct: sumD {float(d0[:,col].sum()):.3g} normD {float(d0[:,col].norm()):.3g} allow {float(a0[:,col].sum()):.3g} kern-emu^2 {float((e0-em)[:, sl].sum()):.3g} emu^2 {float(em[:, sl].sum()):.3g}"
          f" | slipped: sumD {float(d1[:,col].sum()):.3g} normD {float(d1[:,col].norm()):.3g} stat {float(d1[:,col].sum()/d1[:,col].norm()):.3g}")
print(v0.summary()); print(v1.summary())
