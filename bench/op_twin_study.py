"""What the twin run buys the op level in fp32 (docs/error-model.md, "The twin run at the op level"): the judge's
threshold for op-level slips of a correct `fused_moe_lora` (eager, which declares it rounds at its model's points on
the CPU), as a multiple of its own error, judged without a twin (rule 4 allows a quarter of the accumulation's
variance bound: the judge before the forty-fifth session) and as the runner judges it now, with the twin on the case's
reordered view (K permuted through x and every A: each shrink summed in another order, the output's columns
unchanged), beside assert_close(atol=rtol=2e-2).
    python bench/op_twin_study.py [T] [which] [rank] [seed] [H] [I]
"""
import dataclasses
import math
import sys

import torch

from moe_lora_harness.backends.eager import BACKEND as EAGER
from moe_lora_harness.harness.build.properties import view_inputs
from moe_lora_harness.harness.judge.expectation import (Rules, judge_output, judge_twins, op_expectations, row_groups,
                                                        twin_applies)
from moe_lora_harness.harness.selftest.power import _oracle_fails, _tail, bisect_geometric
from moe_lora_harness.harness.spec.case import Case


def run(inp):
    kw = inp.call_kwargs()
    kw["output"] = inp.output.clone()
    EAGER.op(**kw)
    return kw["output"]


def reordered(inp):
    return view_inputs(inp, "reordered")


def with_lists(inp, name, fn):
    return dataclasses.replace(inp, **{name: [fn(t.clone()) for t in getattr(inp, name)]})


def zero_tail(t, dim, a):
    idx = [slice(None)] * t.dim()
    idx[dim] = _tail(t.shape[dim], a)
    t[tuple(idx)] = 0
    return t


def scaled(t, index, f):
    t[index] = t[index] * f
    return t


SLIPS = {
    "shrink-k-tail": lambda i, a: with_lists(i, "lora_a", lambda t: zero_tail(t, 3, a)),
    "expand-n-tail": lambda i, a: with_lists(i, "lora_b", lambda t: zero_tail(t, 2, a)),
    "rank-component": lambda i, a: with_lists(i, "lora_a", lambda t: scaled(t, (..., -1, slice(None)), 1 - a)),
    "scaling": lambda i, a: with_lists(i, "lora_b", lambda t: t * (1 - a)),
    "one-slot": lambda i, a: with_lists(i, "lora_b", lambda t: scaled(t, (0,), 1 - a)),
    "one-token": lambda i, a: dataclasses.replace(i, x=torch.cat([(1 - a) * i.x[:1] + a * i.x[1:2], i.x[1:]])),
}


def main():
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    which = sys.argv[2] if len(sys.argv) > 2 else "w13"
    rank = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    H = int(sys.argv[5]) if len(sys.argv) > 5 else 1024
    I = int(sys.argv[6]) if len(sys.argv) > 6 else 512
    case = Case(level="op", T=T, H=H, I=I, E=8, top_k=2, max_rank=rank, max_loras=4, dtype="float32",
                which=which, seed=seed)
    precision = EAGER.precision_for(case, "cpu")
    inp, truth, emu = op_expectations(case, precision)
    rules = Rules("cpu", EAGER.model_points_only_for("cpu"), row_groups(inp, truth))
    assert twin_applies(case, "cpu", None, rules.points_only)     # the runner runs this twin
    out0, twin0 = run(inp), run(reordered(inp))
    ref = float(torch.linalg.vector_norm(out0.double() - truth.value))
    v_plain = judge_output(case, out0, truth, emu.value, precision, rules)
    v_twin = judge_twins(case, out0, twin0, truth, emu.value, precision, rules)
    print(f"{case.to_json()}: correct kernel: err/||truth|| {ref / float(torch.linalg.vector_norm(truth.value)):.3g}; "
          f"plain {v_plain.summary()}; with twin {v_twin.summary()}")
    print(f"{'slip':<16} {'no twin x':>10} {'twin x':>8} {'oracle x':>9}")
    for name, make in SLIPS.items():
        cache = {}

        def at(a):
            if a not in cache:
                s = make(inp, a)
                out, tw = run(s), run(reordered(s))
                size = float(torch.linalg.vector_norm(out.double() - out0.double())) / ref
                cache[a] = (not judge_output(case, out, truth, emu.value, precision, rules).ok,
                            not judge_twins(case, out, tw, truth, emu.value, precision, rules).ok,
                            _oracle_fails(out, truth.value), size)
            return cache[a]

        def threshold(k):
            if not at(1.0)[k]:
                return "-"
            if at(1e-7)[k]:
                return f"<={at(1e-7)[3]:.3g}"
            return f"{at(bisect_geometric(lambda a: at(a)[k], 1e-7, 1.0))[3]:.3g}"

        print(f"{name:<16} {threshold(0):>10} {threshold(1):>8} {threshold(2):>9}")


if __name__ == "__main__":
    main()
