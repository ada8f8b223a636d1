"""What the twin run buys the op level in fp32 (docs/error-model.md, "The twin run", "At the op level"): the judge's
threshold for op-level slips (harness.selftest.power.OP_SLIPS) of a correct `fused_moe_lora` (eager, which declares
it rounds at its model's points on the CPU), as a multiple of its own error, without the twin and with it
(bench/twin_study.py, on the op case these arguments make), beside assert_close(atol=rtol=2e-2).
`selftest --power --level op` gives the runner's column alone.
    python bench/op_twin_study.py [T] [which] [rank] [seed] [H] [I]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from twin_study import study  # noqa: E402

from moe_lora_harness.backends.eager import BACKEND as EAGER  # noqa: E402
from moe_lora_harness.harness.spec.case import Case  # noqa: E402

# the study's classes (one-row: the first token's row of x, a row offset)
STUDIED = ("shrink-k-tail", "expand-n-tail", "rank-component", "scaling", "one-slot", "one-row")


def main():
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    which = sys.argv[2] if len(sys.argv) > 2 else "w13"
    rank = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    H = int(sys.argv[5]) if len(sys.argv) > 5 else 1024
    I = int(sys.argv[6]) if len(sys.argv) > 6 else 512
    study(EAGER, Case(level="op", T=T, H=H, I=I, E=8, top_k=2, max_rank=rank, max_loras=4, dtype="float32",
                      which=which, seed=seed), STUDIED)


if __name__ == "__main__":
    main()
