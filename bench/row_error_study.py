"""A study, not a rule: how close a correct kernel's squared error per token row is to the emulation's, and to the
model's expectation for it (one rounding at every point the emulation rounds, rule 4's `A_r`).

For the CPU power case (`selftest --power`'s default: eager, H 1024, I 512, E 8, top-2, rank 64, 2 slots) it prints,
over the token rows, the quantiles of ||out_r - truth_r||^2 / ||emu_r - truth_r||^2 (what rule 3's factor 3 allows
up to 9) and of ||emu_r - truth_r||^2 / A_r (how far the model's variance is from the realised error), and the same
over each routed expert's rows. Why: docs/error-model.md, "What the judge cannot see" (item 1).

    python bench/row_error_study.py [--dtype bfloat16,float16] [--tokens 256]
"""
from __future__ import annotations

import argparse

import torch

from moe_lora_harness.backends import BUILTINS
from moe_lora_harness.harness.judge import compare
from moe_lora_harness.harness.selftest import power

F64 = torch.float64


def quantiles(q: torch.Tensor) -> str:
    q = q.sort().values
    n = q.numel()
    at = {"min": 0, "p1": n // 100, "median": n // 2, "p99": n - 1 - n // 100, "max": n - 1}
    return " ".join(f"{k} {float(q[i]):.3f}" for k, i in at.items())


def study(dtype: str, tokens: int) -> None:
    dt = getattr(torch, dtype)
    case = power.power_cases("cpu", tokens=(tokens,), dtypes=(dtype,))[0]
    spec = next(b for b in BUILTINS if b.name == "eager")
    c = power.correct_run(spec, case, "cpu")
    inp, truth, emu, out = c.inputs, c.truth, c.emulation, c.out.to(F64)
    t, e = truth.value, emu.value.to(F64)
    model = compare.other_points(e, truth.round_var, dt).sum(dim=1)       # A_r: one rounding at every point
    kern, emul = ((out - t) ** 2).sum(dim=1), ((e - t) ** 2).sum(dim=1)
    print(f"{dtype}, {tokens} tokens ({case.to_json()}):")
    print(f"  kernel / emulation, per row:    {quantiles(kern / emul)}")
    print(f"  emulation / A_r, per row:       {quantiles(emul / model)}")
    ids = inp.topk_ids.long()
    sets = [(ids == x).any(dim=1) for x in range(int(ids.max()) + 1)]
    ratio = torch.stack([kern[s].sum() / emul[s].sum() for s in sets])
    print(f"  kernel / emulation, per expert: {quantiles(ratio)} ({len(sets)} experts)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16,float16")
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args()
    for d in a.dtype.split(","):
        study(d, a.tokens)
