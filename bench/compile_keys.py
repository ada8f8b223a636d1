"""How many Triton compiles a fuzz palette costs, predicted on a CPU (a benchmark tool, not a test).

Draws N cases of a backend's claim at fuzz's GPU sizes (free shapes, or the compile-class palette), runs
the backend's host code under the Triton interpreter with every kernel launch intercepted: nothing
executes; each launch records the key Triton would compile it under on a GPU (the kernel, its constexprs,
for each integer argument 1 / a multiple of 16 / other, for each tensor its dtype and 16-byte alignment,
num_warps / num_stages). The number of distinct keys among the first n cases is the number of compiles
a campaign of n examples pays (order aside). The device the launch heuristics see is an H200-sized one
(132 SMs). An approximation of Triton's own key (it also splits i32 from i64 and reads pointer
alignment off the real allocation), for designing palettes without a GPU; bench/bench_fuzz.py measures.

  python bench/compile_keys.py --only triton --examples 800
"""
from __future__ import annotations

import argparse
import inspect
import os

os.environ["TRITON_INTERPRET"] = "1"      # before any kernel module imports triton

H200_SMS = 132


class KeyRecorder:
    """Replaces InterpretedFunction.run: records each launch's compile key, runs nothing."""

    def __init__(self):
        self.keys: set = set()
        self.per_case: list = []
        self._current: set = set()

    def install(self):
        import torch
        from triton.runtime import interpreter
        rec = self

        def run(fn_self, *args, grid, warmup=False, **kwargs):
            fn = fn_self.fn
            params = list(inspect.signature(fn).parameters.values())
            bound = dict(zip([p.name for p in params], args), **{k: v for k, v in kwargs.items()
                                                                  if k in {p.name for p in params}})
            dont = set(fn_self.kwargs.get("do_not_specialize", ()) or ())
            parts = []
            for p in params:
                v = bound.get(p.name, p.default)
                if "constexpr" in str(p.annotation):
                    parts.append((p.name, "c", repr(v)))
                elif isinstance(v, torch.Tensor):
                    parts.append((p.name, str(v.dtype), "D" if v.data_ptr() % 16 == 0 else ""))
                elif isinstance(v, bool) or v is None:
                    parts.append((p.name, repr(v)))
                elif isinstance(v, int):
                    spec = "i" if p.name in dont else ("1" if v == 1 else "D" if v % 16 == 0 else "i")
                    parts.append((p.name, spec))
                else:
                    parts.append((p.name, type(v).__name__))
            opts = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k in ("num_warps", "num_stages",
                                                                                   "maxnreg", "num_ctas")))
            key = (fn.__name__, tuple(parts), opts)
            rec.keys.add(key)
            rec._current.add(key)

        interpreter.InterpretedFunction.run = run

    def next_case(self):
        self.per_case.append(len(self.keys))
        self._current = set()


def _h200_device_info():
    from moe_lora_harness.kernels.triton import one_shot, platform, small_batch
    info = platform.DeviceInfo(sm_count=H200_SMS, max_shared_mem=232448, capability=(9, 0), interpreted=False)
    for mod in (platform, one_shot, small_batch):
        mod.device_info = lambda device=None, _i=info: _i


def _launch(spec, case):
    """The backend's host code on `case`'s inputs (CPU tensors; kernel launches are intercepted)."""
    from moe_lora_harness.harness.build.builders import build_expert_inputs, build_op_inputs
    if case.level == "op":
        spec.op(**build_op_inputs(case, "cpu").call_kwargs())
    else:
        spec.experts(build_expert_inputs(case).call("cpu"))


def count(spec, palette: str, n: int, seed: int, level: str = "op") -> dict:
    from moe_lora_harness.harness.draw.profiles import draw_sizes
    from moe_lora_harness.harness.draw.strategies import claimed_cases, examples
    strategy = claimed_cases(spec, "cuda", level, compile_classes=palette == "classes", **draw_sizes("cuda", level))
    cases = examples(strategy, n, seed=seed)
    rec = KeyRecorder()
    rec.install()
    errors = 0
    for case in cases:
        if level == "expert" and (case.tp_size > 1 or case.dispatched):
            rec.next_case()      # TP / EP drivers need ranks: counted as no launch (a lower bound)
            continue
        try:
            _launch(spec, case)
        except Exception:  # noqa: BLE001 - a host-side refusal compiles nothing
            errors += 1
        rec.next_case()
    marks = [m for m in (50, 100, 200, 400, 800, 1600, 3200) if m <= len(cases)]
    return {"palette": palette, "cases": len(cases), "distinct_keys": len(rec.keys), "host_errors": errors,
            "keys_after": {m: rec.per_case[m - 1] for m in marks},
            "by_kernel": _by_kernel(rec.keys)}


def _by_kernel(keys) -> dict:
    out: dict = {}
    for k in keys:
        out[k[0]] = out.get(k[0], 0) + 1
    return dict(sorted(out.items()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="triton")
    p.add_argument("--examples", type=int, default=800)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--palette", choices=("free", "classes", "both"), default="both")
    p.add_argument("--level", choices=("op", "expert"), default="op")
    a = p.parse_args(argv)
    from moe_lora_harness.harness.spec.registry import available_backends
    _h200_device_info()
    spec = available_backends()[a.only]
    for pal in (("free", "classes") if a.palette == "both" else (a.palette,)):
        r = count(spec, pal, a.examples, a.seed, a.level)
        print(f"{pal:8s} {r['cases']} cases: {r['distinct_keys']} distinct compile keys "
              f"(after {', '.join(f'{m}: {v}' for m, v in r['keys_after'].items())}); by kernel {r['by_kernel']}"
              + (f"; {r['host_errors']} host-side errors" if r["host_errors"] else ""))


if __name__ == "__main__":
    main()
