"""One command for the GPU box: the pytest suites on the CUDA device, then the Triton op benchmark.

  python ci/gpu_check.py [--quick] [--out-dir DIR] [--suites suites] [--no-bench] [-- extra bench args]

Runs without TRITON_INTERPRET (real kernels; bf16 cases enabled where the suites support them),
writes pytest's log, the benchmark JSON and Markdown under --out-dir, and exits non-zero if the
suites or the benchmark's output verification fail.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    """Run the suites and the benchmark; return a combined exit status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="benchmark subset (bench --quick)")
    p.add_argument("--out-dir", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    p.add_argument("--suites", default="suites", help="pytest target(s), space separated")
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--no-suites", action="store_true")
    p.add_argument("bench_args", nargs="*", help="extra arguments for bench/bench_lora_op.py (after --)")
    a = p.parse_args(argv)
    out = pathlib.Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    status = 0
    if not a.no_suites:
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *a.suites.split()]
        with open(out / "pytest_gpu.log", "w") as log:
            rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        tail = (out / "pytest_gpu.log").read_text().splitlines()[-15:]
        print("\n".join(tail))
        print(f"pytest exit status {rc}")
        status |= rc != 0
    if not a.no_bench:
        cmd = [sys.executable, str(ROOT / "bench" / "bench_lora_op.py"), "--out", str(out / "bench_lora_op.json"),
               "--md", str(out / "bench_lora_op.md"), *(["--quick"] if a.quick else []), *a.bench_args]
        rc = subprocess.call(cmd, cwd=ROOT, env=env)
        print(f"benchmark exit status {rc}")
        status |= (rc != 0) << 1
    return status


if __name__ == "__main__":
    sys.exit(main())
