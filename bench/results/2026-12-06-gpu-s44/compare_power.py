"""Before/after table of the forty-fourth session's GPU FP8 power (c1/) against the last measurement of each row:
16 tokens from the forty-first session (c7, c8), 256 from the forty-second (c5), 1024 from the forty-third (c3)."""
import json, os
here = os.path.dirname(os.path.abspath(__file__))
base = {("fp8_w8a8", 16): "2026-12-06-gpu-s41/c7/power_fp8_w8a8.json", ("fp8_block", 16): "2026-12-06-gpu-s41/c8/power_fp8_block.json",
        ("fp8_w8a8", 256): "2026-12-06-gpu-s42/c5/power_fp8_w8a8_T256.json", ("fp8_block", 256): "2026-12-06-gpu-s42/c5/power_fp8_block_T256.json",
        ("fp8_w8a8", 1024): "2026-12-06-gpu-s43/c3/power_fp8_w8a8_T1024.json", ("fp8_block", 1024): "2026-12-06-gpu-s43/c3/power_fp8_block_T1024.json"}
def rows(path):
    out = {}
    for r in json.load(open(os.path.join(here, "..", path) if not path.startswith("/") else path)):
        c = json.loads(r["case"])
        out[(c["quant"], c["T"], c.get("dtype", "float16"))] = (r, {s["slip"]: s for s in r["slips"]})
    return out
def fmt(s):
    if s is None: return "-"
    if s["no_effect"]: return "no-op"
    m = s["judge_multiple"]
    return "-" if m is None else ("<=" if s["judge_smallest"] else "") + f"{m:.3g}"
for q in ("fp8_w8a8", "fp8_block"):
    after = rows(os.path.join(here, "c1", f"power_{q}.json"))
    for T in (16, 256, 1024):
        before = rows(base[(q, T)])
        for dt in ("bfloat16", "float16"):
            if (q, T, dt) not in after: continue
            ra, sa = after[(q, T, dt)]; rb, sb = before.get((q, T, dt), (None, {}))
            print(f"{q} {dt} T{T}: correct kernel ratio {rb['kernel_ratio'] if rb else float('nan'):.3g} -> {ra['kernel_ratio']:.3g}")
            print("   " + ", ".join(f"{k} {fmt(sb.get(k))}->{fmt(v)}" for k, v in sa.items()))
