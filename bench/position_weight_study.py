"""A study, not a rule: what rule 4's top-k position sets (`expectation.row_groups`, "weighted top-k position": every
row, each by 1 / its routing weight at that position) buy and cost, through the whole judge.

A mistake in one top-k position's handling (its weight read wrong, its expert's output mis-scaled) reaches each
token's row scaled by the routing weight there, which spans 0.003-0.7 under top-8 softmax routing: the plain sums
over every row and over each expert's rows see it through that unevenness. This measures, with `power.measure`, the
smallest slip of each named class the judge fails, as a multiple of the correct kernel's own error, with the
position sets and without them (the union bound then counts fewer sets, which is what the other classes gain).
docs/error-model.md, "Rule 4 over a top-k position, weighted".

    python bench/position_weight_study.py --device cuda --backend triton_experts --model qwen3-30b-a3b \
        --tokens 256 --dtype float32 --rank 16,32 [--slips router-weight,one-slot-w2,...] [--json PATH]
"""
from __future__ import annotations

import argparse
import json

from moe_lora_harness.backends import BUILTINS
from moe_lora_harness.harness.judge import expectation
from moe_lora_harness.harness.selftest import power
from moe_lora_harness.harness.served.models import model_named

POSITIONS = "weighted top-k position"


def without_positions(inputs, truth):
    """expectation.row_groups with the position sets left out."""
    groups = expectation.row_groups(inputs, truth)
    return groups if groups is None else {k: v for k, v in groups.items() if k != POSITIONS}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="eager")
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", default="256")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rank", default="32")
    ap.add_argument("--slips", default="router-weight,one-slot-w2,rank-component,scaling,one-token")
    ap.add_argument("--json")
    a = ap.parse_args()
    spec = next(b for b in BUILTINS if b.name == a.backend)
    slips = [s for s in power.SLIPS if s.name in a.slips.split(",")]
    cases = power.power_cases(a.device, layers=(model_named(a.model),), tokens=[int(t) for t in a.tokens.split(",")],
                              dtypes=a.dtype.split(","), ranks=[int(r) for r in a.rank.split(",")])
    rows = []
    for case in cases:
        got = {}
        for label, groups in (("without", without_positions), ("with", expectation.row_groups)):
            power.row_groups = groups
            r = power.measure(spec, case, a.device, slips=slips)
            got[label] = {s.slip: (s.judge.multiple, s.oracle.multiple, s.oracle_only) for s in r.slips}
            got[label + "_kernel_ratio"] = r.kernel_ratio
        power.row_groups = expectation.row_groups
        print(f"{case.to_json()} (correct kernel's ratio {got['without_kernel_ratio']:.3f} without, "
              f"{got['with_kernel_ratio']:.3f} with)")
        for s in slips:
            (j0, o, n0), (j1, _, n1) = got["without"][s.name], got["with"][s.name]
            print(f"  {s.name:<16} judge x without {j0 if j0 is None else f'{j0:.3g}':>8}  with "
                  f"{j1 if j1 is None else f'{j1:.3g}':>8}   assert_close x {o if o is None else f'{o:.3g}':>8}"
                  f"   outputs only it fails: {n0} / {n1}", flush=True)
        rows.append(dict(case=case.to_json(), backend=a.backend, device=a.device, **got))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
