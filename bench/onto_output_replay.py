"""Replay the fiftieth session's failing short-sums case on our compiled one-shot op, as it is or as it was before
355bb45 (`--as-before`: `_plus_delta` back to `prev + d`, which Triton's combiner folds into a dot accumulating from
the output in fp32), and print the verdict with its precision diagnosis. On a GPU the old kernel should fail and be
named `outacc` (the expand summed onto the output); in the interpreter no combiner runs, so both pass.

    python bench/onto_output_replay.py --device cuda [--as-before]

Run each form in its own process: a Triton function's globals are read when it first compiles.
"""
from __future__ import annotations

import argparse


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--as-before", action="store_true", help="the kernel before 355bb45 (prev + d, foldable)")
    args = ap.parse_args()
    if args.as_before:
        import triton

        from moe_lora_harness.kernels.triton import one_shot

        @triton.jit
        def _foldable(prev, d, omask):
            return prev + d
        one_shot._plus_delta = _foldable
    from moe_lora_harness.backends.triton_op import TRITON_ONE_SHOT
    from moe_lora_harness.harness.execution.execute import InProcess
    from moe_lora_harness.harness.execution.runner import run_case
    from moe_lora_harness.harness.spec.case import Case
    from moe_lora_harness.suites.kernels.test_triton_lora_op_smoke import FOLDED_EXPAND_CASE
    out = run_case(TRITON_ONE_SHOT, Case.from_json(FOLDED_EXPAND_CASE), args.device, executor=InProcess(), reruns=0)
    print(f"{'before 355bb45' if args.as_before else 'as it is'} on {args.device}: {out.status}")
    print(out.detail or "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
