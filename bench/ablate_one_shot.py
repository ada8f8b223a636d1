"""Where does the one-shot kernel's time go? Time variants that leave one stage out (GPU only, not a test).

For each shape, graph-replay medians (µs) of the heuristic launch config on:
  full        the real call
  store_only  add_inputs=False: the expand stores without reading the previous output (no RMW read)
  short_k     the shrink runs over the first 128 of K only (the x / A streaming mostly gone)
  expand_only short_k and store_only together: B loads, the dot and the output store
  rmw         the gathered-row read-modify-write floor kernel of bench_lora_op (no shrink, no B, no dot)
Results of the shortened variants are wrong on purpose; only their times matter. `--ncu` runs each
variant once without graphs, for `ncu --kernel-name regex:_one_shot_kernel` to capture.

  python bench/ablate_one_shot.py --shapes mixtral:w13:64:4096,gptoss20b:w2:64:4096 [--out a.json] [--ncu]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys


import torch  # noqa: E402

from bench_lora_op import _graph_ms, build_case, copy_bandwidth, floor_bytes, op_call, rmw_floor_ms  # noqa: E402


def variants(call):
    """name -> OpCall with one stage left out."""
    short = dataclasses.replace(call, hidden=min(call.hidden, 128))
    return {"full": call, "store_only": dataclasses.replace(call, add_inputs=False), "short_k": short,
            "expand_only": dataclasses.replace(short, add_inputs=False)}


def main(argv=None) -> int:
    """Time (or run once for ncu) the variants of each shape; print a table, optionally write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", required=True, help="model:which:R:T,...")
    p.add_argument("--out", default=None)
    p.add_argument("--ncu", action="store_true", help="run each variant once, no timing (for ncu)")
    p.add_argument("--config", default=None, help="JSON OneShotConfig fields overriding the heuristic")
    a = p.parse_args(argv)
    os.environ["MOE_LORA_UNCHECKED"] = "1"
    from moe_lora_harness.kernels.triton import one_shot
    bw = 0.0 if a.ncu else copy_bandwidth()
    rows = []
    for spec in a.shapes.split(","):
        model, which, R, T = spec.split(":")
        c = build_case(model, which, int(T), int(R))
        out = c["out"].clone()
        call = op_call(c, "sorted", out)
        cfg = one_shot.choose_config(call)
        if a.config:
            cfg = dataclasses.replace(cfg, **json.loads(a.config))
        row = dict(shape=spec, config=dataclasses.asdict(cfg))
        for name, v in variants(call).items():
            if a.ncu:
                one_shot.run_one_shot(v, cfg)
                torch.cuda.synchronize()
            else:
                row[name] = _graph_ms(lambda v=v: one_shot.run_one_shot(v, cfg), 10, 50) * 1e3
        if not a.ncu:
            row["rmw"] = rmw_floor_ms(c, 10, 50)[0] * 1e3
            row["floor"] = floor_bytes(c) / bw * 1e6
            print(f"{spec:24s} " + " ".join(f"{k}={row[k]:.1f}" for k in
                                            ("floor", "rmw", "full", "store_only", "short_k", "expand_only")),
                  row["config"], flush=True)
        rows.append(row)
        del c, out
        torch.cuda.empty_cache()
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(dict(copy_bw=bw, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
