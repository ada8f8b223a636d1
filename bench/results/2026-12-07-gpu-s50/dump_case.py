"""A failing op case's worst elements on the device: our one-shot op's and the eager op's outputs beside the truth,
the declared model's emulation and the per-element bound (the runner's own judge), in units of the output's spacing.
    python dump_case.py CASE_JSON [backend]"""
import sys

import torch

from moe_lora_harness.harness.execution.execute import InProcess
from moe_lora_harness.harness.execution.runner import expectations, run_case
from moe_lora_harness.harness.judge.compare import rule2_bound
from moe_lora_harness.harness.judge.expectation import judging
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.registry import available_backends

case = Case.from_json(sys.argv[1])
name = sys.argv[2] if len(sys.argv) > 2 else "triton_one_shot"
dev = "cuda" if torch.cuda.is_available() else "cpu"
specs = available_backends()
outs = {}
for b in (name, "eager"):
    spec = specs[b]
    exp = expectations(spec, case, dev)
    inp = exp.inputs.to(dev)
    kw = inp.call_kwargs()
    kw["output"] = inp.output.clone()
    spec.op(**kw)
    torch.cuda.synchronize() if dev == "cuda" else None
    outs[b] = kw["output"].to("cpu", torch.float64)
    print(b, run_case(spec, case, dev, executor=InProcess(), reruns=0).message[:300])
tv, emu = exp.truth.value.cpu(), exp.emulation.value.cpu()
written, kpr, names = judging(case, exp.truth)
written = written.cpu()
t = exp.truth
bound = rule2_bound(outs[name], tv, emu, t.scale.cpu(), written, dtype=torch.float32, k_plus_r=kpr,
                    underflow=None if t.underflow is None else t.underflow.cpu(), work_dtype=torch.float32,
                    acc_var=None if t.acc_var is None else t.acc_var.cpu(),
                    round_var=None if t.round_var is None else t.round_var.cpu())
err = (outs[name] - tv).abs()
rel = torch.where(written, err / bound, torch.zeros_like(err))
idx = torch.topk(rel.flatten(), 12).indices
sp = lambda v: float(torch.finfo(torch.float32).eps) * max(abs(v), 1e-30)  # noqa: E731
print("precision", exp.precision, "device", dev)
print("index            truth           kernel-truth  eager-truth   emu-truth     bound      rel   "
      "(in spacings of |truth|)   scale  acc_sd")
for i in idx.tolist():
    ix = torch.unravel_index(torch.tensor(i), rel.shape)
    ix = tuple(int(v) for v in ix)
    tr = float(tv[ix])
    s = sp(tr)
    print(ix, f"{tr:+.6e} {float(outs[name][ix]) - tr:+.3e} {float(outs['eager'][ix]) - tr:+.3e} "
          f"{float(emu[ix]) - tr:+.3e} {float(bound[ix]):.3e} {float(rel[ix]):.3f}  "
          f"[{(float(outs[name][ix]) - tr) / s:+.2f} {(float(outs['eager'][ix]) - tr) / s:+.2f} "
          f"{(float(emu[ix]) - tr) / s:+.2f} {float(bound[ix]) / s:.2f}]  {float(t.scale[ix]):.3e} "
          f"{float(t.acc_var[ix]) ** 0.5:.3e}")
print("differ from eager:", int(((outs[name] != outs["eager"]) & written).sum()), "of", int(written.sum()))
