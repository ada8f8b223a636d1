import torch
from moe_lora_harness.harness.selftest import power as P
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.registry import available_backends
case = Case.from_json('{"E":16,"H":2,"I":4,"T":276,"activation":"relu2_no_mul","call_tokens":4,"level":"expert","mapping":"skewed","max_loras":1,"max_rank":4,"seed":182161,"top_k":1}')
c = P.correct_run(available_backends()["eager"], case, "cpu")
t = c.truth; r = 88
print("twin", c.twin is not None, "precision", c.precision, "points_only", c.points_only)
o = c.out.double()[r]; tr = t.value[r]; em = c.emulation.value[r]
print("out", o.tolist(), "truth", tr.tolist(), "emu", em.tolist())
print("scale", t.scale[r].tolist(), "acc_var", None if t.acc_var is None else t.acc_var[r].tolist(), "round_var", None if t.round_var is None else t.round_var[r].tolist())
print("under", t.underflow[r].tolist() if t.underflow is not None else None)
inp = c.inputs
print(type(inp).__name__, [f for f in dir(inp) if not f.startswith('_')][:40])
from moe_lora_harness.harness.build.expert_runner import expert_expectations
for prec in ("one_shot", "two_kernel", "small_batch"):
    _, _, e2 = expert_expectations(case, prec, emulation_only=True)
    print(prec, e2.value[r].tolist())
c2 = case.replace(call_tokens=0)
print(c2.to_json())
_, t2, e3 = expert_expectations(c2, "one_shot")
print("one call: emu", e3.value[r].tolist())
print("inputs row", r, "topk", inp.topk_ids[r].tolist(), inp.topk_weights[r].tolist(), "lora", inp.token_lora_mapping[r].tolist(), "hidden", inp.hidden[r].tolist())
