"""Where a workload's time goes (a look, not a test or a benchmark): cProfile text of one workload, the functions
by own time and by cumulative time. On a GPU, set CUDA_LAUNCH_BLOCKING=1 so that a kernel's time lands on the
Python line that launched it.

  judge   one judged expert case of the catalogue (bench_judge.judge_once), after an untimed warm-up case
  layer   the layer search against a correct layer (as `fuzz --level layer` runs it), supervised (the worker's
          own side profiled through harness.execution.worker.PROFILE_VAR) and then in-process, --budget seconds each

  python bench/profile_paths.py judge --model deepseek-v3 --tokens 16384 --out DIR
  python bench/profile_paths.py layer --only layer_triton --budget 30 --out DIR
  python bench/profile_paths.py stats --out DIR --title check A.prof [B.prof ...]   (profiles made elsewhere, e.g.
          `python -m cProfile -o A.prof -m moe_lora_harness check ...` and the workers' PROFILE_VAR folder)
"""
from __future__ import annotations

import argparse
import cProfile
import glob
import io
import os
import pathlib
import pstats
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

TOP = 45


def _stats_text(sources, title: str) -> str:
    """The TOP functions by own time and by cumulative time of one or more profiles (a Profile or .prof paths)."""
    buf = io.StringIO()
    st = pstats.Stats(*sources, stream=buf) if isinstance(sources, list) else pstats.Stats(sources, stream=buf)
    buf.write(f"== {title}\n")
    st.sort_stats("tottime").print_stats(TOP)
    st.sort_stats("cumulative").print_stats(TOP)
    return buf.getvalue()


def judge(a) -> str:
    import torch
    from bench_judge import bench_case, judge_once
    from moe_lora_harness.harness.spec.case import Case
    from moe_lora_harness.harness.served.models import model_named
    judge_once(Case(level="expert", T=8, dtype="bfloat16", seed=1), a.device)      # context, cuBLAS: not profiled
    out = []
    for T in (int(t) for t in a.tokens.split(",")):
        case = bench_case(model_named(a.model), T)
        prof = cProfile.Profile()
        prof.enable()
        times, peak = judge_once(case, a.device)
        prof.disable()
        head = " ".join(f"{k} {v:.2f}s" for k, v in times.items())
        out.append(_stats_text(prof, f"judge {a.model} T={T}: {head}; peak {peak / 2**30:.1f} GiB; "
                                     f"CUDA_LAUNCH_BLOCKING={os.environ.get('CUDA_LAUNCH_BLOCKING', '')} "
                                     f"torch {torch.__version__}"))
    return "\n".join(out)


def layer(a) -> str:
    from moe_lora_harness.harness.layer.layer_machine import fuzz_configs, search_layers
    from moe_lora_harness.harness.spec.registry import available_backends
    from moe_lora_harness.harness.execution.worker import DEFAULT_TIMEOUT, PROFILE_VAR, executor_for
    spec = available_backends()[a.only]
    configs = fuzz_configs(spec, a.device)
    out = []
    worker_dir = pathlib.Path(a.out) / "worker_profiles"
    worker_dir.mkdir(parents=True, exist_ok=True)
    for in_process in (False, True):
        if not in_process:
            os.environ[PROFILE_VAR] = str(worker_dir)
        executor = executor_for(in_process, DEFAULT_TIMEOUT)
        prof = cProfile.Profile()
        try:
            t0 = time.perf_counter()
            prof.enable()
            r = search_layers(spec, configs, a.device, executor=executor, budget_s=a.budget,
                              max_examples=10**9, seed=a.seed)
            prof.disable()
            wall = time.perf_counter() - t0
        finally:
            executor.close()
            os.environ.pop(PROFILE_VAR, None)
        mode = "in-process" if in_process else "supervised"
        out.append(_stats_text(prof, f"layer search {spec.name} {mode}: {r.examples} scenarios in {wall:.1f} s "
                                     f"({r.examples / wall:.2f}/s), {len(r.found)} failures; the caller's side"))
        if not in_process:
            profs = sorted(glob.glob(str(worker_dir / "worker-*.prof")))
            if profs:
                out.append(_stats_text(profs, f"layer search {spec.name} supervised: the worker's side "
                                              f"({len(profs)} worker process(es))"))
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("judge", "layer", "stats"))
    p.add_argument("profiles", nargs="*", help="stats: the .prof files, merged")
    p.add_argument("--title", default="profile")
    p.add_argument("--device", default=None)
    p.add_argument("--model", default="deepseek-v3")
    p.add_argument("--tokens", default="16384")
    p.add_argument("--only", default="layer_triton")
    p.add_argument("--budget", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    a = p.parse_intermixed_args(argv)
    import torch
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    pathlib.Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.what == "stats":
        text = _stats_text(a.profiles, f"{a.title} ({len(a.profiles)} profile(s))")
    else:
        text = judge(a) if a.what == "judge" else layer(a)
    path = pathlib.Path(a.out) / f"profile_{a.title if a.what == 'stats' else a.what}.txt"
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
