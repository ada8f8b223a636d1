import torch, dataclasses
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.registry import available_backends
from moe_lora_harness.harness.build.builders import build_expert_inputs
from moe_lora_harness.harness.build.expert_runner import run_calls
E = available_backends()["eager"]
case = Case.from_json('{"E":16,"H":2,"I":4,"T":276,"activation":"relu2_no_mul","call_tokens":4,"level":"expert","mapping":"skewed","max_loras":1,"max_rank":4,"seed":182161,"top_k":1}')
inp = build_expert_inputs(case, "cpu")
call = inp.call("cpu"); out_calls = run_calls(E, call, case).clone()
call = inp.call("cpu"); E.experts(call); out_whole = call.output.clone()
print("per call", out_calls[88].tolist(), "whole", out_whole[88].tolist())
print("differ rows", (out_calls != out_whole).any(1).nonzero().flatten().tolist()[:20])
print("mapping around 88", inp.token_lora_mapping[84:92].tolist(), "lora enabled", inp.stacked.adapter_enabled.tolist())
from moe_lora_harness.harness.build.expert_runner import expert_forward
from moe_lora_harness.reference.precision import precision as mp
from moe_lora_harness.kernels import eager_experts
fwd, args, kw = expert_forward(case, inp)
emu = fwd(*args, precision=mp("one_shot", torch.float16), magnitudes=False, return_intermediates=True, **kw)
r = 88
print("ref cache1", emu.cache1[r].tolist()); print("ref cache2", emu.cache2[r].tolist()); print("ref cache3", emu.cache3[r].tolist())
# eager's intermediates: capture via patching activation and fused_moe_lora
cap = {}
orig_act = eager_experts.activation
def act(c1, name):
    cap["cache1"] = c1.clone(); out = orig_act(c1, name); cap["cache2"] = out.clone(); return out
eager_experts.activation = act
orig_f = eager_experts.fused_moe_lora
calls = []
def f(out, *a, **k):
    before = out.clone(); orig_f(out, *a, **k); calls.append((before, out.clone()))
eager_experts.fused_moe_lora = f
call = inp.call("cpu"); E.experts(call)
print("eager cache1", cap["cache1"][r].tolist()); print("eager cache2", cap["cache2"][r].tolist())
print("eager cache3 before w2 lora", calls[1][0].reshape(276, -1)[r].tolist(), "after", calls[1][1].reshape(276, -1)[r].tolist())
print("eager cache1 before w13 lora", calls[0][0].reshape(276, -1)[r].tolist())
