"""Benchmark dual-stream LoRA on a GPU (not a test): how much of the LoRA time the aux stream hides.

Per model shape (qwen3moe, mixtral, gptoss20b) and T, bf16, rank 16, 4 LoRA slots, every token with an
adapter, silu, the Triton experts three ways:
  base    TritonExperts without LoRA;
  seq     TritonExperts with LoRA, deltas added in place on one stream;
  dual    DualStreamTritonExperts: deltas on the aux stream into zeroed buffers, joined by events, at every
          T (dual_stream_max_tokens=None); `default mode` says what the layer's default batch-size gate
          (lora_context.DUAL_STREAM_MAX_TOKENS) runs for that T.
hidden = (seq - dual) / (seq - base): the fraction of the LoRA time the overlap hides (1 = all of it,
0 = none, < 0 = the second stream costs more than it hides). Times are CUDA-graph replay medians
(the captured graph keeps the fork/join, so the branches run concurrently as in vLLM), optionally eager
too (--eager). Each case is first checked: dual equals seq bit for bit unless the LoRA op takes the
small-batch path (one rounding in seq, two in dual), where the largest difference is reported.
Runs with MOE_LORA_UNCHECKED=1 (no id-range host sync per call).

  python bench/bench_dual_stream.py --out dual.json --md dual.md [--quick] [--budget-s 600]
      [--models qwen3moe,mixtral] [--T 1,16] [--eager]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time


import torch  # noqa: E402

from bench_experts import time_eager, time_graph  # noqa: E402
from shapes import MODELS, T_ALL  # noqa: E402

T_QUICK = (16, 1024)
RANK, NUM_LORAS = 16, 4
VARIANTS = ("base", "seq", "dual")


def build_model(model: str, seed: int = 0) -> dict:
    """bf16 expert weights and a rank-16 LoRA stack (4 slots) on the GPU for one model shape."""
    H, I, E, k = MODELS[model]
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed)
    rn = lambda *s, fan: torch.randn(*s, device=dev, dtype=dt, generator=g) / math.sqrt(fan)  # noqa: E731
    L, R = NUM_LORAS, RANK
    return dict(model=model, H=H, I=I, E=E, k=k, w13=rn(E, 2 * I, H, fan=H), w2=rn(E, H, I, fan=I),
                a13=[rn(L, E, R, H, fan=H) for _ in range(2)], b13=[rn(L, E, I, R, fan=R) for _ in range(2)],
                a2=[rn(L, E, R, I, fan=I)], b2=[rn(L, E, H, R, fan=R)],
                enabled=torch.tensor([1] * L + [0], dtype=torch.int32, device=dev))


def build_runs(m: dict, T: int, seed: int = 1) -> dict:
    """Three zero-argument forwards (base, seq, dual) writing their own output, plus what they need."""
    from moe_lora_harness.kernels.experts.config import MoEConfig
    from moe_lora_harness.kernels.experts.dual_stream_experts import DualStreamTritonExperts
    from moe_lora_harness.kernels.experts.lora_context import MoELoRAContext
    from moe_lora_harness.kernels.experts.triton_experts import TritonExperts

    H, E, k = m["H"], m["E"], m["k"]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed + T)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
    topk = torch.rand(T, E, device=dev, generator=g).argsort(dim=1)[:, :k].to(torch.int32).contiguous()
    tw = torch.softmax(torch.rand(T, k, device=dev, generator=g), dim=-1).float()
    mapping = torch.randint(0, NUM_LORAS, (T,), device=dev, generator=g, dtype=torch.int32)
    common = dict(device="cuda", dtype=torch.bfloat16, activation="silu", H=H, I=m["I"], E=E, top_k=k)
    base_cfg = MoEConfig(**common)
    lora_cfg = MoEConfig(**common, lora_enabled=True, max_lora_rank=RANK)

    def ctx(dual: bool) -> MoELoRAContext:
        return MoELoRAContext(w13_lora_a_stacked=m["a13"], w13_lora_b_stacked=m["b13"], w2_lora_a_stacked=m["a2"],
                              w2_lora_b_stacked=m["b2"], adapter_enabled=m["enabled"], max_loras=NUM_LORAS,
                              top_k=k, w13_num_slices=2, local_num_experts=E, token_lora_mapping=mapping,
                              dual_stream=dual, dual_stream_max_tokens=None)  # measure the overlap at every T

    outs = {v: torch.empty(T, H, device=dev, dtype=torch.bfloat16) for v in VARIANTS}
    layers = {"base": (TritonExperts(base_cfg), None), "seq": (TritonExperts(lora_cfg), ctx(False)),
              "dual": (DualStreamTritonExperts(lora_cfg), ctx(True))}

    def forward(v):
        experts, c = layers[v]
        return lambda: experts.apply(outs[v], x, m["w13"], m["w2"], tw, topk, lora_ctx=c)

    path = TritonExperts.lora_path(lora_cfg, T, NUM_LORAS)
    return dict(fns={v: forward(v) for v in VARIANTS}, outs=outs, path=path, dual=layers["dual"][0])


def check(runs: dict) -> dict:
    """Dual vs seq: bitwise equality expected except on the small-batch path (report the largest difference)."""
    for v in VARIANTS:
        runs["fns"][v]()
    torch.cuda.synchronize()
    d, s = runs["outs"]["dual"], runs["outs"]["seq"]
    bitwise = bool(torch.equal(d.view(torch.int16), s.view(torch.int16)))
    diff = float((d.float() - s.float()).abs().max())
    scale = float(s.float().abs().max()) or 1.0
    ok = bitwise or (runs["path"] == "small_batch" and diff <= 4 * 2.0 ** -8 * scale)
    sched = runs["dual"].dual_stream_schedule
    return dict(bitwise=bitwise, max_abs_diff=diff, ok=ok,
                streams_created=sched.created_streams, events_created=sched.created_events)


def markdown(rows: list[dict], eager: bool) -> str:
    """The results as a Markdown table, one row per (model, T)."""
    from moe_lora_harness.kernels.experts.dual_stream_experts import DualStreamTritonExperts

    head = ("| model | T | LoRA path | base ms | seq ms | dual ms | LoRA ms | hidden | dual speedup | check | "
            "default mode |")
    if eager:
        head += " eager seq | eager dual |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['model']} | {r['T']} | skipped: {r['skipped']} |" + " |" * (head.count("|") - 4))
            continue
        hid = "n/a" if r["hidden"] is None else f"{r['hidden']:.0%}"
        line = (f"| {r['model']} | {r['T']} | {r['path']} | {r['base_ms']:.4f} | {r['seq_ms']:.4f} | "
                f"{r['dual_ms']:.4f} | {r['lora_ms']:.4f} | {hid} | {r['seq_ms'] / r['dual_ms']:.2f}x | "
                f"{'ok' if r['check']['ok'] else 'MISMATCH'} | "
                f"{'dual' if DualStreamTritonExperts.dual_stream_applies(False, r['T']) else 'one stream'} |")
        if eager:
            line += f" {r['eager_seq_ms']:.4f} | {r['eager_dual_ms']:.4f} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """Parse arguments, run every (model, T) within the budget, write JSON/Markdown; 1 if a check failed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON results file")
    p.add_argument("--md", help="Markdown table file")
    p.add_argument("--quick", action="store_true", help=f"T in {T_QUICK} only")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting new cases after this many seconds")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--T", default=None, help="comma-separated token counts (default: all, or the quick set)")
    p.add_argument("--eager", action="store_true", help="also time eager calls (host overhead included)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_dual_stream needs a CUDA device", file=sys.stderr)
        return 2
    os.environ.setdefault("MOE_LORA_UNCHECKED", "1")
    models = [s for s in a.models.split(",") if s]
    bad = [s for s in models if s not in MODELS]
    if bad:
        p.error(f"--models: unknown {bad}; known: {sorted(MODELS)}")
    Ts = [int(t) for t in a.T.split(",")] if a.T else list(T_QUICK if a.quick else T_ALL)
    t0, rows, failed = time.time(), [], False
    for model in models:
        m = None
        for T in Ts:
            if a.budget_s is not None and time.time() - t0 > a.budget_s:
                rows.append(dict(model=model, T=T, skipped=f"--budget-s {a.budget_s:g} spent"))
                continue
            m = m or build_model(model)
            runs = build_runs(m, T)
            chk = check(runs)
            failed |= not chk["ok"]
            ms = {v: time_graph(runs["fns"][v]) for v in VARIANTS}
            lora = ms["seq"] - ms["base"]
            row = dict(model=model, T=T, path=runs["path"], base_ms=ms["base"], seq_ms=ms["seq"], dual_ms=ms["dual"],
                       lora_ms=lora, hidden=(ms["seq"] - ms["dual"]) / lora if lora > 1e-4 else None, check=chk)
            if a.eager:
                row["eager_seq_ms"] = time_eager(runs["fns"]["seq"], 25, 100)
                row["eager_dual_ms"] = time_eager(runs["fns"]["dual"], 25, 100)
            rows.append(row)
            hid = "n/a" if row["hidden"] is None else f"{row['hidden']:.0%}"
            print(f"{model:10s} T={T:5d} {runs['path']:11s} base {ms['base']:.4f}  seq {ms['seq']:.4f}  "
                  f"dual {ms['dual']:.4f} ms  hidden {hid}  check {'ok' if chk['ok'] else 'MISMATCH'}", flush=True)
            del runs
            torch.cuda.empty_cache()
        del m
        torch.cuda.empty_cache()
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rank=RANK, loras=NUM_LORAS,
               dtype="bfloat16", activation="silu", elapsed_s=time.time() - t0)
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    table = markdown(rows, a.eager)
    if a.md:
        pathlib.Path(a.md).write_text(f"# Dual-stream LoRA overlap ({env['gpu']})\n\n"
                                      "hidden = (seq - dual) / (seq - base): share of the LoRA time the aux stream "
                                      "hides.\n\n" + table)
    print(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
