"""Token 88's w13 LoRA delta in the open false verdict: its exact value beside the fp16 midpoint the kernels' fp32
sum lands on."""
import torch
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.build.builders import build_expert_inputs
case = Case.from_json('{"E":16,"H":2,"I":4,"T":276,"activation":"relu2_no_mul","call_tokens":4,"level":"expert","mapping":"skewed","max_loras":1,"max_rank":4,"seed":182161,"top_k":1}')
inp = build_expert_inputs(case, "cpu")
x = inp.hidden[88].double(); e = int(inp.topk_ids[88, 0]); st = inp.stacked
A = st.w13_a[0][0, e].double(); B = st.w13_b[0][0, e].double()   # (R, H), (I, R)
u = (A @ x).half().double(); d = B @ u
print("u", u.tolist()); print("delta exact (from rounded u)", d[1].item())   # (torch's double -> half rounds twice)
lo, hi = -0.181640625, -0.1815185546875
print("midpoint", (lo+hi)/2, "distance", d[1].item() - (lo+hi)/2, "in spacings", (d[1].item() - (lo+hi)/2)/(hi-lo))
print("fp32 of sum", (B.float() @ u.float())[1].item())
