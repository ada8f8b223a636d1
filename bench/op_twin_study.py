"""What the twin run buys the op level in fp32 (docs/error-model.md, "The twin run at the op level"): the judge's
threshold for op-level slips (harness.selftest.power.OP_SLIPS) of a correct `fused_moe_lora` (eager, which declares
it rounds at its model's points on the CPU), as a multiple of its own error, judged without a twin (rule 4 allows a
quarter of the accumulation's variance bound: the judge before the forty-fifth session) and as the runner judges it
now, with the twin on the case's reordered view (K permuted through x and every A: each shrink summed in another
order, the output's columns unchanged), beside assert_close(atol=rtol=2e-2). `selftest --power --level op` gives the
runner's column alone.
    python bench/op_twin_study.py [T] [which] [rank] [seed] [H] [I]
"""
import sys

import torch

from moe_lora_harness.backends.eager import BACKEND as EAGER
from moe_lora_harness.harness.judge.expectation import Rules, judge_output, judge_twins, row_groups
from moe_lora_harness.harness.selftest.power import OP_SLIPS, _oracle_fails, bisect_geometric, correct_run, runner
from moe_lora_harness.harness.spec.case import Case

# the study's classes (one-row: the first token's row of x, a row offset)
STUDIED = ("shrink-k-tail", "expand-n-tail", "rank-component", "scaling", "one-slot", "one-row")


def main():
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    which = sys.argv[2] if len(sys.argv) > 2 else "w13"
    rank = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    H = int(sys.argv[5]) if len(sys.argv) > 5 else 1024
    I = int(sys.argv[6]) if len(sys.argv) > 6 else 512
    case = Case(level="op", T=T, H=H, I=I, E=8, top_k=2, max_rank=rank, max_loras=4, dtype="float32",
                which=which, seed=seed)
    c = correct_run(EAGER, case, "cpu")
    assert c.twin is not None     # the runner runs this twin (expectation.twin_applies)
    inp, truth, emu, precision, out0 = c.inputs, c.truth, c.emulation, c.precision, c.out
    rules = Rules("cpu", c.points_only, row_groups(inp, truth))
    run = runner(EAGER, case, "cpu")
    ref = float(torch.linalg.vector_norm(out0.double() - truth.value))
    v_plain = judge_output(case, out0, truth, emu.value, precision, rules)
    v_twin = judge_twins(case, out0, c.twin, truth, emu.value, precision, rules)
    print(f"{case.to_json()}: correct kernel: err/||truth|| {ref / float(torch.linalg.vector_norm(truth.value)):.3g}; "
          f"plain {v_plain.summary()}; with twin {v_twin.summary()}")
    print(f"{'slip':<16} {'no twin x':>10} {'twin x':>8} {'oracle x':>9}")
    for slip in (s for s in OP_SLIPS if s.name in STUDIED):
        cache = {}

        def at(a):
            if a not in cache:
                out, tw = run(slip.make(inp, a)), run(slip.make(c.twin_inputs, a))
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

        print(f"{slip.name:<16} {threshold(0):>10} {threshold(1):>8} {threshold(2):>9}")


if __name__ == "__main__":
    main()
