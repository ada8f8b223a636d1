"""A correct fp32 kernel whose activation errs by a few ulps (deterministic per value, so both twins share it):
does the twin-judged rule 4 pass it? (eager experts, the CPU power case or a model's routing)."""
import sys, torch, torch.nn.functional as F
from moe_lora_harness.kernels import eager_experts
from moe_lora_harness.backends import BUILTINS
from moe_lora_harness.harness.selftest import power
from moe_lora_harness.harness.served.models import model_named
from moe_lora_harness.harness.judge.expectation import Rules, row_groups, judge_twins, judge_output
ULPS = float(sys.argv[1]); T = int(sys.argv[2]); model = sys.argv[3] if len(sys.argv) > 3 else None
def sloppy(v):
    y = F.silu(v)
    bits = y.view(torch.int32)
    sign = ((bits >> 3) & 1).to(y.dtype) * 2 - 1        # a fixed sign per value (its bits)
    mag = (((bits >> 5) & 7).to(y.dtype) + 1) / 8      # 1/8..1 of ULPS, fixed per value
    return y * (1 + sign * mag * ULPS * 2.0 ** -23)
eager_experts._ACT_AND_MUL["silu"] = sloppy
spec = {b.name: b for b in BUILTINS}["eager"]
layers = [model_named(model)] if model else None
kw = dict(layers=layers) if layers else {}
case = power.power_cases("cpu", tokens=[T], dtypes=["float32"], ranks=[16 if model else 64], **kw)[0]
print("case", case.H, case.I, case.E, case.top_k, case.activation)
c = power.correct_run(spec, case, "cpu")
rules = Rules("cpu", c.points_only, row_groups(c.inputs, c.truth))
v = judge_twins(case, c.out, c.twin, c.truth, c.emulation.value, c.precision, rules)
v0 = judge_output(case, c.out, c.truth, c.emulation.value, c.precision, rules)
print(f"ulps {ULPS}: twin-judged ok {v.ok} ratio {v.ratio:.3g} excess {v.excess:.3g} {v.message[:200]} | alone ok {v0.ok} excess {v0.excess:.3g}")
