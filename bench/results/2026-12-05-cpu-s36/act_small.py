"""A correct fp32 kernel (eager) whose SiLU is off by a fixed +-N ulps at every value, run through the judge with
the twin: python act_small.py ULPS_LIST SEEDS [undeclared] (undeclared: model_points_only False)."""
import sys, dataclasses, torch, torch.nn.functional as F
from moe_lora_harness.kernels import eager_experts
from moe_lora_harness.backends.eager import BACKEND as EAGER, run_experts
from moe_lora_harness.harness.execution.execute import InProcess
from moe_lora_harness.harness.execution.runner import run_case
from moe_lora_harness.harness.spec.case import Case
CASE = Case(level="expert", T=128, H=256, I=128, E=4, top_k=2, max_loras=2, max_rank=8, mapping="mixed",
            dtype="float32", seed=3)
real = eager_experts._ACT_AND_MUL["silu"]
def make(ulps):
    def sloppy(v):
        y = real(v)
        bits = y.view(torch.int32)
        sign = ((bits >> 3) & 1).to(y.dtype) * 2 - 1
        return y * (1 + sign * ulps * 2.0 ** -23)
    return sloppy
if sys.argv[3:] == ["undeclared"]:
    EAGER = dataclasses.replace(EAGER, model_points_only=False)
for u in [float(x) for x in sys.argv[1].split(",")]:
    eager_experts._ACT_AND_MUL["silu"] = make(u)
    for seed in range(int(sys.argv[2])):
        r = run_case(EAGER, CASE.replace(seed=seed), "cpu", executor=InProcess(), reruns=0)
        print(u, seed, r.status, (r.message or "")[:150])
