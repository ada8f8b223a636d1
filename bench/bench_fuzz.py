"""Fuzz throughput (a benchmark, not a test): examples per second of a campaign, compile time apart from run
time, and the gain of drawing shapes from compile classes.

Every example of a campaign (harness/campaign.py, in-process, no reruns, no shrink) is timed and tagged with
its compile key: the shape values a Triton launch specializes on (dtype, level, which/slices, K, N, rank,
block, layout, top_k, activation). The first example of a key pays the compile (on a GPU; the CPU
interpreter compiles nothing, so both columns agree there); later ones reuse the kernel cache. `--palette
free` draws dimensions freely, `--palette classes` from the strategies' compile classes (a few values per
alignment class), and `--palette both` runs one after the other and reports the gain in examples per
minute. Planted-bug time to detection is `moe-lora-harness selftest --json`'s (recorded beside this).

  python bench/bench_fuzz.py --only triton --level op --device cuda --budget 120 --palette both --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def compile_key(case) -> tuple:
    """The values a Triton launch of this case specializes on (shape classes only, never element data)."""
    if case.level == "op":
        return ("op", case.dtype, case.which, case.num_slices, case.K, case.N, case.max_rank, case.block_size_m,
                case.layout, case.top_k, case.mul_routed_weight)
    return ("expert", case.dtype, case.activation, case.H, case.I, case.max_rank, case.top_k, case.quant,
            case.bias, case.lora, case.local_experts)


class TimedExecutor:
    """In-process executor that records (compile key, seconds, first time this key was seen) per call."""

    supervised = False

    def __init__(self):
        from moe_lora_harness.harness.execute import InProcess
        self.inner = InProcess()
        self.rows = []
        self.seen = set()

    def execute(self, spec, case, device, poison=None):
        key = compile_key(case)
        t0 = time.perf_counter()
        ex = self.inner.execute(spec, case, device, poison)
        self.rows.append({"first": key not in self.seen, "seconds": time.perf_counter() - t0})
        self.seen.add(key)
        return ex

    def close(self):
        pass


def run(spec, device, level, budget_s, palette, seed):
    from moe_lora_harness.harness.campaign import Campaign
    from moe_lora_harness.harness.strategies import claimed_cases
    cpu = not str(device).startswith("cuda")
    sizes = dict(max_T=12 if cpu else 256, max_dim=96 if cpu else 1024)
    kw = {"compile_classes": palette == "classes"}
    try:
        strategy = claimed_cases(spec, device, level, **sizes, **kw)
    except TypeError:
        if palette == "classes":
            raise SystemExit("harness.strategies has no compile_classes option: --palette classes cannot run")
        strategy = claimed_cases(spec, device, level, **sizes)
    ex = TimedExecutor()
    t0 = time.perf_counter()
    r = Campaign(spec, device, level, ex, budget_s=budget_s, max_examples=10**9, seed=seed, reruns=0,
                 shrink=False, max_found=10**6).run(strategy)
    wall = time.perf_counter() - t0
    first = [x["seconds"] for x in ex.rows if x["first"]]
    again = [x["seconds"] for x in ex.rows if not x["first"]]
    return {"palette": palette, "examples": r.examples, "wall_s": round(wall, 2),
            "examples_per_min": round(60 * r.examples / wall, 1) if wall else 0.0,
            "compile_keys": len(ex.seen), "new_key_calls": len(first), "cached_key_calls": len(again),
            "median_new_key_s": round(statistics.median(first), 4) if first else None,
            "median_cached_key_s": round(statistics.median(again), 4) if again else None,
            "time_in_new_key_calls_s": round(sum(first), 2), "time_in_cached_key_calls_s": round(sum(again), 2),
            "distinct_failures": len(r.found)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", action="append", default=[])
    p.add_argument("--only", required=True)
    p.add_argument("--level", choices=("op", "expert"), default="op")
    p.add_argument("--device", default=None)
    p.add_argument("--budget", type=float, default=60.0, help="seconds per palette")
    p.add_argument("--palette", choices=("free", "classes", "both"), default="both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    from moe_lora_harness.harness.device import prepare_device
    from moe_lora_harness.harness.registry import available_backends, select
    device = prepare_device(a.device)
    spec = select(available_backends(extra_refs=a.backend), [a.only])[a.only]
    palettes = ("free", "classes") if a.palette == "both" else (a.palette,)
    runs = [run(spec, device, a.level, a.budget, pal, a.seed) for pal in palettes]
    import torch
    machine = {"device": device, "platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    try:
        import triton
        machine["triton"] = triton.__version__
    except ImportError:
        pass
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"backend": a.only, "level": a.level, "budget_s": a.budget, "machine": machine, "runs": runs}
    if len(runs) == 2 and runs[0]["examples_per_min"]:
        doc["gain_examples_per_min"] = round(runs[1]["examples_per_min"] / runs[0]["examples_per_min"], 2)
    (out / "bench_fuzz.json").write_text(json.dumps(doc, indent=1))
    lines = [f"Fuzz throughput: {a.only} ({a.level} level) on {device}, {a.budget:g} s per palette", "",
             "| palette | examples | examples/min | compile keys | median new-key call (s) | median cached call (s) "
             "| time in new-key calls (s) |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['palette']} | {r['examples']} | {r['examples_per_min']} | {r['compile_keys']} | "
                     f"{r['median_new_key_s']} | {r['median_cached_key_s']} | {r['time_in_new_key_calls_s']} |")
    if "gain_examples_per_min" in doc:
        lines.append(f"\ngain (classes / free): {doc['gain_examples_per_min']}x examples per minute")
    (out / "bench_fuzz.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
