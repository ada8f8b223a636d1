"""Where our kernels round: the `model_points_only` declaration shared by every Triton backend (op, experts, layer).

Our Triton kernels accumulate every `tl.dot` and every sum in fp32 and round to the working dtype exactly where
their precision preset rounds (the rank intermediate, the delta, the GEMM outputs, the activation, moe_sum), on
the GPU as in the CPU interpreter; fp32 operands take IEEE fp32 dots, never TF32. So the judge's rule 4 allows them
their fp32 accumulation alone (docs/error-model.md, "Rule 4 for a kernel that rounds only at its model's points").
Measured before declaring it: docs/benchmarks.md, twenty-third session.
"""
TRITON_POINTS_ONLY = {"cpu": True, "cuda": True}
