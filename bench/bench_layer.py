"""Benchmark the stateful MoE+LoRA layer on a GPU (not a test): what its state handling costs.

Per model shape (mixtral at TP 8: H 4096, I 1792, E 8, k 2; qwen3moe: H 2048, I 768, E 128, k 8), bf16, silu,
4 LoRA slots of rank 16, every token with an adapter, T in 1, 8, 64, 256, per experts class (triton,
dual_stream), median ms of:
  plain   FusedMoEKernel(no-EP prepare/finalize, experts).apply on the caller's tensors (eager);
  forward StatefulMoELoRALayer.forward: copies into the static buffers, the per-batch LoRA metadata, the same
          apply on views of the buffers, the output cloned (eager);
  graph   plain apply captured as a CUDA graph and replayed (bench_experts.time_graph);
  replay  StatefulMoELoRALayer.replay: the copies, the padding of the mapping, the graph replay, the clone.
Eager calls are host-bound (Python launches), so plain, forward and replay are timed in alternating rounds
(wall clock over --calls calls, synchronized; the median of --rounds rounds), which keeps clock and host
drift out of their differences; graph is do_bench's median of CUDA-graph replays. state = forward - plain
(what the layer adds to an eager call), replay - graph (what it adds to a graph replay). Each case first
checks that forward and replay equal plain bit for bit. Runs with MOE_LORA_UNCHECKED=1 (no host sync).

  python bench/bench_layer.py --out layer.json [--models mixtral_tp8,qwen3moe] [--T 1,8] [--experts triton]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

import torch

MODELS = {  # name: (H, I per TP rank, E, top_k)
    "mixtral_tp8": (4096, 14336 // 8, 8, 2),
    "qwen3moe": (2048, 768, 128, 8),
}
T_ALL = (1, 8, 64, 256)
RANK, NUM_LORAS = 16, 4
EXPERTS = ("triton", "dual_stream")
TIMES = ("plain_ms", "forward_ms", "graph_ms", "replay_ms")


def experts_class(name: str):
    """The experts class a --experts name stands for."""
    if name == "triton":
        from moe_lora_harness.kernels.experts.triton_experts import TritonExperts
        return TritonExperts
    from moe_lora_harness.kernels.experts.dual_stream_experts import DualStreamTritonExperts
    return DualStreamTritonExperts


def build_layer(model: str, experts: str, max_tokens: int, seed: int = 0):
    """A bf16 StatefulMoELoRALayer on the GPU with NUM_LORAS random rank-RANK adapters loaded."""
    from moe_lora_harness.kernels.experts.config import MoEConfig
    from moe_lora_harness.kernels.layer.stateful import StatefulMoELoRALayer

    H, I, E, k = MODELS[model]
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed)
    rn = lambda *s, fan: torch.randn(*s, device=dev, dtype=dt, generator=g) / math.sqrt(fan)  # noqa: E731
    config = MoEConfig(device="cuda", dtype=dt, activation="silu", H=H, I=I, E=E, top_k=k, lora_enabled=True,
                       max_lora_rank=RANK)
    layer = StatefulMoELoRALayer(experts_class(experts), config, rn(E, 2 * I, H, fan=H), rn(E, H, I, fan=I),
                                 max_loras=NUM_LORAS, max_tokens=max_tokens, device=dev)
    for slot in range(NUM_LORAS):
        layer.set_lora(slot, [rn(E, RANK, H, fan=H) for _ in range(2)], [rn(E, I, RANK, fan=RANK) for _ in range(2)],
                       rn(E, RANK, I, fan=I), rn(E, H, RANK, fan=RANK))
    return layer


def batch(layer, T: int, seed: int = 1):
    """(hidden, topk_weights, topk_ids, mapping) of T tokens, each with an adapter."""
    c, dev = layer.config, layer.device
    g = torch.Generator(device=dev).manual_seed(seed + T)
    x = torch.randn(T, c.H, device=dev, dtype=c.dtype, generator=g)
    ids = torch.rand(T, c.E, device=dev, generator=g).argsort(dim=1)[:, :c.top_k].to(torch.int32).contiguous()
    tw = torch.softmax(torch.rand(T, c.top_k, device=dev, generator=g), dim=-1).float()
    mapping = torch.randint(0, NUM_LORAS, (T,), device=dev, generator=g, dtype=torch.int32)
    return x, tw, ids, mapping


def plain_call(layer, x, tw, ids, mapping):
    """A zero-argument FusedMoEKernel.apply on the caller's tensors, with a context of its own over the layer's
    stacked LoRA buffers (what a stateless caller runs), and its output tensor."""
    import dataclasses
    ctx = dataclasses.replace(layer.lora_ctx, token_lora_mapping=mapping)
    out = torch.empty_like(x)
    return (lambda: layer.kernel.apply(x, layer.w13, layer.w2, tw, ids, lora_ctx=ctx, output=out)), out


def run_case(layer, T: int, rounds: int, calls: int) -> dict:
    """Check, then time the four variants for T tokens (the layer captures a graph at T first)."""
    from bench_experts import time_graph  # noqa: E402 - bench/ is on sys.path when run as a script

    x, tw, ids, mapping = batch(layer, T)
    layer.set_mapping(mapping)
    plain, out = plain_call(layer, x, tw, ids, mapping)
    plain()
    fwd = layer.forward(x, tw, ids)
    layer.capture(T)
    rep_out = layer.replay(x, tw, ids)
    torch.cuda.synchronize()
    same = lambda a, b: bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))  # noqa: E731
    check = dict(forward_bitwise=same(fwd, out), replay_bitwise=same(rep_out, out))
    ms = time_rounds(dict(plain_ms=plain, forward_ms=lambda: layer.forward(x, tw, ids),
                          replay_ms=lambda: layer.replay(x, tw, ids)), rounds, calls)
    ms["graph_ms"] = time_graph(plain, 25, 100)
    return dict(ms, state_ms=ms["forward_ms"] - ms["plain_ms"], replay_extra_ms=ms["replay_ms"] - ms["graph_ms"],
                check=check, ok=check["forward_bitwise"] and check["replay_bitwise"])


def time_rounds(fns: dict, rounds: int, calls: int) -> dict:
    """name -> median ms of one call: each round times `calls` calls of every fn in turn (synchronized wall clock),
    the starting fn rotating, so drift hits every fn alike."""
    names = list(fns)
    for fn in fns.values():        # warm-up
        fn()
    samples = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(calls):
                fns[n]()
            torch.cuda.synchronize()
            samples[n].append((time.perf_counter() - t) * 1e3 / calls)
    return {n: sorted(v)[len(v) // 2] for n, v in samples.items()}


def table(rows: list) -> str:
    """The results as a Markdown table."""
    head = ("| model | experts | T | plain ms | forward ms | forward - plain | graph ms | replay ms | replay - graph "
            "| check |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r['experts']} | {r['T']} | skipped: {r['skipped']} | | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['experts']} | {r['T']} | {r['plain_ms']:.4f} | {r['forward_ms']:.4f} | "
                     f"{r['state_ms']:+.4f} | {r['graph_ms']:.4f} | {r['replay_ms']:.4f} | "
                     f"{r['replay_extra_ms']:+.4f} | {'ok' if r['ok'] else 'MISMATCH'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """Parse arguments, run every (model, experts, T) within the budget, write JSON; 1 if a check failed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON results file")
    p.add_argument("--md", help="Markdown table file")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--experts", default=",".join(EXPERTS), help="comma-separated subset of " + ",".join(EXPERTS))
    p.add_argument("--T", default=None, help=f"comma-separated token counts (default {','.join(map(str, T_ALL))})")
    p.add_argument("--rounds", type=int, default=15, help="alternating rounds of eager timing (median)")
    p.add_argument("--calls", type=int, default=10, help="calls per round")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting new cases after this many seconds")
    a = p.parse_args(argv)
    models = [s for s in a.models.split(",") if s]
    experts = [s for s in a.experts.split(",") if s]
    bad = [s for s in models if s not in MODELS] + [s for s in experts if s not in EXPERTS]
    if bad:
        p.error(f"unknown --models/--experts {bad}; known: {sorted(MODELS)} / {list(EXPERTS)}")
    Ts = [int(t) for t in a.T.split(",")] if a.T else list(T_ALL)
    if not torch.cuda.is_available():
        print("bench_layer needs a CUDA device", file=sys.stderr)
        return 2
    os.environ.setdefault("MOE_LORA_UNCHECKED", "1")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    t0, rows, failed = time.time(), [], False
    for model in models:
        for ex in experts:
            layer = None
            for T in Ts:
                row = dict(model=model, experts=ex, T=T)
                if a.budget_s is not None and time.time() - t0 > a.budget_s:
                    rows.append(dict(row, skipped=f"--budget-s {a.budget_s:g} spent"))
                    continue
                layer = layer or build_layer(model, ex, max(Ts))
                row.update(run_case(layer, T, a.rounds, a.calls))
                failed |= not row["ok"]
                rows.append(row)
                print(f"{model:12s} {ex:11s} T={T:4d}  plain {row['plain_ms']:.4f}  forward {row['forward_ms']:.4f}  "
                      f"graph {row['graph_ms']:.4f}  replay {row['replay_ms']:.4f} ms  "
                      f"{'ok' if row['ok'] else 'MISMATCH'}", flush=True)
            del layer
            torch.cuda.empty_cache()
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rank=RANK, loras=NUM_LORAS,
               dtype="bfloat16", activation="silu", elapsed_s=time.time() - t0)
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    out = table(rows)
    if a.md:
        pathlib.Path(a.md).write_text(f"# Stateful layer: state handling and graph replay ({env['gpu']})\n\n" + out)
    print(out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
