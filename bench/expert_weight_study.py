"""A study, not a rule: would rule 4 on an expert's rows see one expert's mistake sooner with the rows weighted by
their routing weight to that expert?

A mistake in one expert's computation reaches each of its rows scaled by that row's routing weight w, so its rows'
excesses D_r grow like w^2 and a plain self-normalised sum over them (`compare.excess`) is held back by their
unevenness: with D_r ~ w_r^2 it is at most sqrt(n) E[w^2] / sqrt(E[w^4]). Any weights c_r >= 0 fixed by the routing
(not by the output judged) keep rule 4's tail: sum c_r D_r / sqrt(sum c_r^2 D_r^2) is self-normalised over
independent rows of mean <= 0 as before. This measures, on a CPU case with many rows per expert, the smallest
`one-expert-w13` slip (power.SLIPS) each weighting fails, as a multiple of the correct kernel's own error, beside
assert_close(2e-2), every weighting at the union bound of all of them, and each weighting's statistic on the correct
output (it must stay <= 1). docs/error-model.md, "What the judge cannot see".

    python bench/expert_weight_study.py [--tokens 1024] [--dtype bfloat16] [--experts 8] [--top-k 2] [--judge]
"""
from __future__ import annotations

import argparse
import math

import torch

from moe_lora_harness.backends import BUILTINS
from moe_lora_harness.harness.build.expert_runner import run_calls
from moe_lora_harness.harness.judge import compare
from moe_lora_harness.harness.selftest import power

F64 = torch.float64
WEIGHTINGS = {"plain": lambda w: torch.ones_like(w), "w": lambda w: w, "w^2": lambda w: w * w,
              "1/w": lambda w: 1 / w, "1/w^2": lambda w: 1 / (w * w), "1/sqrt w": lambda w: w.rsqrt()}


def row_excess(out, truth, emu, dt) -> torch.Tensor:
    """Rule 4's D_r (compare.row_excess) for a backend that declares model_points_only, as eager does on the CPU."""
    return compare.row_excess(out.to(F64), truth.value, emu, torch.ones_like(truth.value, dtype=torch.bool),
                              truth.acc_var, truth.round_var, dtype=dt, underflow=truth.underflow,
                              model_points_only=True)[0]


def statistic(d: torch.Tensor, c: torch.Tensor, z: float) -> float:
    x = c * d
    return compare.self_normalised(float(x.sum()), float(torch.linalg.vector_norm(x)), z)


def study(tokens: int, dtype: str, E: int, top_k: int) -> None:
    dt = getattr(torch, dtype)
    case = power.power_cases("cpu", tokens=(tokens,), dtypes=(dtype,))[0].replace(E=E, top_k=top_k)
    spec = next(b for b in BUILTINS if b.name == "eager")
    c = power.correct_run(spec, case, "cpu")
    assert c.points_only, "eager declares model_points_only on the CPU"
    inp, truth, emu, out0 = c.inputs, c.truth, c.emulation.value.to(F64), c.out
    own = float(torch.linalg.vector_norm(out0.to(F64) - truth.value))
    ids, w = inp.topk_ids.long(), inp.topk_weights.to(F64)
    rows = (ids == 0).any(dim=1)                                          # expert 0: the slip's expert
    w0 = (w * (ids == 0)).sum(dim=1)[rows]
    z = compare.excess_sigmas(len(WEIGHTINGS))
    print(f"{case.to_json()}: expert 0 has {int(rows.sum())} rows (routing weights {float(w0.min()):.3f}-"
          f"{float(w0.max()):.3f}); z = {z:.2f} over {len(WEIGHTINGS)} weightings")
    d0 = row_excess(out0, truth, emu, dt)[rows]
    print("  correct output:", ", ".join(f"{k} {statistic(d0, f(w0), z):.3f}" for k, f in WEIGHTINGS.items()))
    slip = next(s for s in power.SLIPS if s.name == "one-expert-w13")
    cache = {}

    def at(alpha):
        if alpha not in cache:
            out = run_calls(spec, slip.make(inp, alpha).call("cpu"), case)
            d = row_excess(out, truth, emu, dt)[rows]
            size = float(torch.linalg.vector_norm(out.to(F64) - out0.to(F64))) / own
            cache[alpha] = ({k: statistic(d, f(w0), z) > 1 for k, f in WEIGHTINGS.items()}
                            | {"oracle": power._oracle_fails(out, truth.value)}, size)
        return cache[alpha]

    for k in list(WEIGHTINGS) + ["oracle"]:
        lo, hi = 1e-7, 1.0
        if not at(hi)[0][k]:
            print(f"  {k:8s} not failed at full size")
            continue
        for _ in range(16):
            mid = math.sqrt(lo * hi)
            lo, hi = (lo, mid) if at(mid)[0][k] else (mid, hi)
        print(f"  {k:8s} fails from {at(hi)[1]:.3f} times the kernel's own error")


def whole_judge(tokens: int, dtype: str, E: int, top_k: int) -> None:
    """The one-expert slip's threshold through the whole judge (power.measure), with rule 4's weighted expert sets
    and without them."""
    from moe_lora_harness.harness.judge import expectation
    case = power.power_cases("cpu", tokens=(tokens,), dtypes=(dtype,))[0].replace(E=E, top_k=top_k)
    spec = next(b for b in BUILTINS if b.name == "eager")
    slips = [s for s in power.SLIPS if s.name == "one-expert-w13"]
    full = expectation.row_groups
    plain = lambda i, t: {k: v for k, v in (full(i, t) or {}).items()               # noqa: E731
                          if not isinstance(v, compare.ByInverseWeight)}
    try:
        for label, groups in (("with the weighted expert sets", full), ("plain sets only", plain)):
            power.row_groups = groups
            (s,) = power.measure(spec, case, "cpu", slips=slips, steps=12).slips
            print(f"  whole judge, {label}: fails from {s.judge.multiple:.3g}, assert_close from "
                  f"{s.oracle.multiple:.3g}, {s.oracle_only} outputs only assert_close fails")
    finally:
        power.row_groups = full


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--judge", action="store_true", help="also through the whole judge (power.measure), with and "
                    "without the weighted expert sets")
    a = ap.parse_args()
    study(a.tokens, a.dtype, a.experts, a.top_k)
    if a.judge:
        whole_judge(a.tokens, a.dtype, a.experts, a.top_k)
