"""Joint grid search of one-shot launch configs at large T (GPU only; a tuning tool, not a test).

The greedy `bench_lora_op.py --sweep` moves one knob at a time. At large T the kernel's occupancy is
capped by registers AND shared memory together (ncu: 2 blocks per SM from each), so one knob alone cannot
show a gain; this script times the product of sub_m x block_n x block_k x num_stages x num_warps at the
heuristic's npid / split_k / two_slices, then the N split (npid) around the best three. Compiles run first
in `--jobs` parallel processes (the timing process then hits Triton's cache). Graph-replay medians, µs.

  python bench/grid_one_shot.py --out grid.json [--shapes model:which:R:T,...] [--jobs 14]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import pathlib
import subprocess
import sys
import time


import torch  # noqa: E402

from bench_lora_op import _graph_ms, build_case, op_call  # noqa: E402
from shapes import MODELS  # noqa: E402

GRIDS = {
    # tiles: rows, N / K tiles, pipeline depth and warps (8 warps only for 64-row tiles of >= 128 columns)
    "tiles": [dict(sub_m=s, block_n=bn, block_k=bk, num_stages=ns, num_warps=nw)
              for s, bn, bk, ns, nw in itertools.product((32, 64), (64, 128, 256), (64, 128), (2, 3), (4, 8))
              if nw == 4 or (s == 64 and bn >= 128)],
    # stages: the shrink's and the expand loop's pipeline depths apart, a register cap, warps
    "stages": [dict(num_stages=ns, expand_stages=es, maxnreg=mr, num_warps=nw)
               for ns, es, mr, nw in itertools.product((1, 2, 3), (1, 2, 3, 4), (0, 128, 168), (4, 8))],
    # regs: around the streaming heuristic: pipeline depths, register cap, N tile (4 warps)
    "regs": [dict(num_stages=ns, expand_stages=es, maxnreg=mr, block_n=bn, num_warps=4)
             for ns, es, mr, bn in itertools.product((2, 3), (0, 2, 3), (0, 128, 168), (64, 128))],
    # pipe: the expand loop's pipeline depth x register cap, all else the heuristic's (B tiles pipelined)
    "pipe": [dict(expand_stages=es, maxnreg=mr) for es, mr in itertools.product((0, 2, 3, 4), (0, 128, 168, 200))],
}


def default_shapes() -> list:
    """Every T >= 1024 shape of the benchmark: 3 models x w13/w2 x R 16/64 x T 1024/4096."""
    return [f"{m}:{w}:{r}:{t}" for m in MODELS for w in ("w13", "w2") for r in (16, 64) for t in (1024, 4096)]


def bases(call, around=None) -> list:
    """[heuristic] or [heuristic, around]: the configs a grid is laid around (around: a config dict)."""
    from moe_lora_harness.kernels.triton.one_shot import OneShotConfig, choose_config

    heuristic = choose_config(call)
    base = OneShotConfig(**around) if around else heuristic
    return [heuristic, base] if base != heuristic else [heuristic]


def grid_point(base, g: dict, call):
    """`base` with the grid point's knobs, or None where the point does not apply (rows > align block)."""
    cand = dataclasses.replace(base, **g)
    return cand if cand.sub_m <= call.block_m else None


def configs(call, grid: list, around=None) -> list:
    """The heuristic config first, then `around` (if given), then every distinct applicable grid point."""
    out = bases(call, around)
    for g in grid:
        cand = grid_point(out[-1], g, call)
        if cand is not None and cand not in out:
            out.append(cand)
    return out


def compile_only(points: list, grid: list, around: dict) -> None:
    """Run the given (shape, grid index) configs once each: fills Triton's on-disk cache for the timing
    process (index -1: the heuristic and `around` configs)."""
    from moe_lora_harness.kernels.triton.one_shot import run_one_shot

    by_shape: dict = {}
    for spec, j in points:
        by_shape.setdefault(spec, []).append(j)
    for spec, idx in by_shape.items():
        m, w, r, t = spec.split(":")
        c = build_case(m, w, int(t), int(r))
        call = op_call(c, "sorted", c["out"].clone())
        b = bases(call, around.get(spec))
        for j in idx:
            for cfg in (b if j < 0 else [grid_point(b[-1], grid[j], call)]):
                if cfg is None:
                    continue
                try:
                    run_one_shot(call, cfg)
                except Exception as e:  # noqa: BLE001 - the timing pass reports it
                    print(f"compile {spec} {cfg}: {type(e).__name__}", flush=True)
        torch.cuda.synchronize()
        del c, call
        torch.cuda.empty_cache()


def time_shape(spec: str, rep: int, grid: list, around: dict | None = None, npid_search: bool = True) -> dict:
    """Heuristic, two-kernel, every grid config, then (npid_search) npid 1..16 around the best three (ms)."""
    from moe_lora_harness.kernels.triton.one_shot import run_one_shot
    from moe_lora_harness.kernels.triton.two_kernel import run_two_kernel

    m, w, r, t = spec.split(":")
    c = build_case(m, w, int(t), int(r))
    call = op_call(c, "sorted", c["out"].clone())

    def ms(cfg):
        try:
            return _graph_ms(lambda: run_one_shot(call, cfg), 5, rep)
        except Exception as e:  # noqa: BLE001
            return f"error {type(e).__name__}"

    cfgs = configs(call, grid, around)
    times = [ms(cfg) for cfg in cfgs]
    res = [(dataclasses.asdict(cfg), t) for cfg, t in zip(cfgs, times)]
    ok = sorted(((t, cfg) for cfg, t in zip(cfgs, times) if isinstance(t, float)), key=lambda p: p[0])
    seen = set(cfgs)
    for _, cfg in (ok[:3] if npid_search else []):
        for npid in (1, 2, 4, 8, 16):
            cand = dataclasses.replace(cfg, npid=npid)
            if cand not in seen:
                seen.add(cand)
                res.append((dataclasses.asdict(cand), ms(cand)))
    two = _graph_ms(lambda: run_two_kernel(call), 5, rep)
    best = min((x for x in res if isinstance(x[1], float)), key=lambda x: x[1])
    row = dict(shape=spec, heuristic=res[0], two_kernel=two, best=best, results=res)
    print(f"{spec:24s} heuristic {res[0][1] * 1e3:7.1f}  best {best[1] * 1e3:7.1f}  two_kernel {two * 1e3:7.1f}  "
          f"{best[0]}", flush=True)
    del c, call
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    """Precompile in parallel, then time each shape's grid in this process; write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None, help="model:which:R:T,... (default: every T >= 1024 shape)")
    p.add_argument("--out", default=None)
    p.add_argument("--jobs", type=int, default=14, help="parallel compile processes (0: compile while timing)")
    p.add_argument("--rep", type=int, default=40, help="do_bench rep (ms) per config")
    p.add_argument("--grid", default="tiles", choices=sorted(GRIDS))
    p.add_argument("--no-npid", action="store_true", help="skip the npid search around the best three")
    p.add_argument("--around", default=None, help="a grid JSON: search around each shape's best config there")
    p.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--points", default="[]", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    grid = GRIDS[a.grid]
    around = {}
    if a.around:
        around = {r["shape"]: r["best"][0] for r in json.loads(pathlib.Path(a.around).read_text())["rows"]}
    os.environ["MOE_LORA_UNCHECKED"] = "1"
    shapes = a.shapes.split(",") if a.shapes else default_shapes()
    if a.compile_only:
        compile_only(json.loads(a.points), grid, around)
        return 0
    t0 = time.time()
    if a.jobs > 0:
        extra = ["--grid", a.grid] + (["--around", a.around] if a.around else [])
        n = len(shapes) * len(grid)
        chunks = [[] for _ in range(a.jobs)]
        for i, spec in enumerate(shapes):  # shapes are few: each process gets a slice of every shape's grid
            for j in range(-1, len(grid)):
                chunks[(i * len(grid) + j) % a.jobs].append((spec, j))
        procs = [subprocess.Popen([sys.executable, __file__, "--compile-only", "--shapes", ",".join(shapes),
                                   "--points", json.dumps(ch)] + extra) for ch in chunks if ch]
        for pr in procs:
            pr.wait()
        print(f"compiled {n} configs in {time.time() - t0:.0f} s", flush=True)
    rows = [time_shape(s, a.rep, grid, around.get(s), not a.no_npid) for s in shapes]
    print(f"total {time.time() - t0:.0f} s")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(dict(grid=grid, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
