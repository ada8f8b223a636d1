"""The FP8 row's aggregate floor, term by term, as a GPU judge takes it (worst-case accumulation) and a CPU judge
(statistical), at Qwen3-30B-A3B's layer."""
import sys, math, torch
from moe_lora_harness.harness.selftest import power
from moe_lora_harness.harness.served.models import model_named
from moe_lora_harness.harness.build.expert_runner import expert_expectations
from moe_lora_harness.harness.judge.compare import EPS32, ACC_SIGMAS, _eps
q, dt, T = sys.argv[1], sys.argv[2], int(sys.argv[3])
case = power.power_cases("cpu", layers=[model_named("qwen3-30b-a3b")], tokens=[T], dtypes=[dt], ranks=[16], quant=q)[0]
inp, truth, emu = expert_expectations(case, "one_shot", device="cpu")
tv = truth.value; F = torch.float64
emu_err = float((emu.value - tv).norm())
kpr = case.H + case.I + case.max_rank
worst = math.sqrt(kpr) * EPS32 * float(truth.scale.norm())
stat = ACC_SIGMAS * math.sqrt(float(truth.acc_var.clamp_min(0).sum())) if truth.acc_var is not None else float("nan")
half = 0.5 * _eps(getattr(torch, dt)) * float(tv.norm())
of = float(truth.one_flip.max()) if truth.one_flip is not None else 0.0
sf = float(truth.slack_flip.norm()) if truth.slack_flip is not None else 0.0
print(f"{q} {dt} T{T}: |truth| {float(tv.norm()):.4g} emu err {emu_err:.4g} | floor terms: half-ulp {half:.4g}, "
      f"acc worst-case (GPU) {worst:.4g}, acc statistical (CPU) {stat:.4g}, one_flip {of:.4g}, slack_flip {sf:.4g}")
