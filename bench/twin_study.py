"""What the twin run buys a case (docs/error-model.md, "The twin run"): the judge's threshold for each slip
(harness.selftest.power.SLIPS, or OP_SLIPS at the op level) of a correct backend, as a multiple of its own error,
judged without a twin (rule 4 allows a quarter of the accumulation's variance bound) and as the runner judges it,
with the twin on the case's reordered view, beside assert_close(atol=rtol=2e-2). Any case the twin applies to:
TP (each rank's shard permuted within), dispatched EP, one rank, the op level.
    python bench/twin_study.py CASE_JSON [backend] [slip,slip,...]
"""
import sys

import torch

from moe_lora_harness.harness.judge.expectation import Rules, judge_output, judge_twins, row_groups
from moe_lora_harness.harness.selftest.power import OP_SLIPS, SLIPS, _oracle_fails, bisect_geometric, correct_run, runner
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.build.properties import twin_columns
from moe_lora_harness.harness.spec.registry import available_backends


def study(spec, case: Case, names=None, device: str = "cpu") -> None:
    """Print each slip's three thresholds (without the twin, with it, assert_close) on `case`."""
    c = correct_run(spec, case, device)
    assert c.twin is not None, "the runner runs no twin on this case (expectation.twin_applies)"
    inp, truth, emu, precision, out0 = c.inputs, c.truth, c.emulation, c.precision, c.out
    rules = Rules(device, c.points_only, row_groups(inp, truth))
    run = runner(spec, case, device)
    ref = float(torch.linalg.vector_norm(out0.double() - truth.value))
    v_plain = judge_output(case, out0, truth, emu.value, precision, rules)
    v_twin = judge_twins(case, out0, c.twin, truth, emu.value, precision, rules)
    print(f"{spec.name} {case.to_json()}: correct kernel: err/||truth|| "
          f"{ref / float(torch.linalg.vector_norm(truth.value)):.3g}; plain {v_plain.summary()}; with twin "
          f"{v_twin.summary()}", flush=True)
    print(f"{'slip':<18} {'no twin x':>10} {'twin x':>8} {'oracle x':>9}")
    slips = OP_SLIPS if case.level == "op" else SLIPS
    for slip in (s for s in slips if names is None or s.name in names):
        cache = {}

        def at(a):
            if a not in cache:
                out, tw = run(slip.make(inp, a)), run(slip.make(c.twin_inputs, a))
                size = float(torch.linalg.vector_norm(out.double() - out0.double())) / ref
                cache[a] = (not judge_output(case, out, truth, emu.value, precision, rules).ok,
                            not judge_twins(case, out, twin_columns(tw, case), truth, emu.value, precision,
                                            rules).ok,
                            _oracle_fails(out, truth.value), size)
            return cache[a]

        def threshold(k):
            if not at(1.0)[k]:
                return "-"
            if at(1e-7)[k]:
                return f"<={at(1e-7)[3]:.3g}"
            return f"{at(bisect_geometric(lambda a: at(a)[k], 1e-7, 1.0))[3]:.3g}"

        if at(1.0)[3] == 0:
            print(f"{slip.name:<18} {'no-op':>10}", flush=True)
            continue
        print(f"{slip.name:<18} {threshold(0):>10} {threshold(1):>8} {threshold(2):>9}", flush=True)


def main():
    case = Case.from_json(sys.argv[1])
    spec = available_backends()[sys.argv[2] if len(sys.argv) > 2 else "eager"]
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else None
    study(spec, case, names)


if __name__ == "__main__":
    main()
