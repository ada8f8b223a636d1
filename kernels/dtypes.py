"""The working dtypes of our kernels: each torch dtype with the name the capability tables spell it with,
and which of them our Triton kernels compute in on each device kind."""
from __future__ import annotations

from moe_lora_harness.op_contract.validate import FLOAT_DTYPES   # the op's working dtypes (vLLM's contract)

DTYPE_NAMES = {dt: str(dt).removeprefix("torch.") for dt in FLOAT_DTYPES}   # float16, bfloat16, float32
DTYPES = {name: dt for dt, name in DTYPE_NAMES.items()}   # name -> torch dtype

# On the CPU our Triton kernels run in Triton's interpreter, which cannot do bf16 arithmetic.
CPU_BF16 = "the Triton interpreter cannot do bf16 arithmetic (computes on bit patterns; Triton issue 11584)"
TRITON_DTYPES = {"cpu": frozenset({"float16", "float32"}), "cuda": frozenset({"float16", "bfloat16", "float32"})}
TRITON_DTYPE_REASONS = {("cpu", "bfloat16"): CPU_BF16}
# A Triton kernel that tiles 16-bit operands only.
TRITON_16BIT_DTYPES = {"cpu": frozenset({"float16"}), "cuda": frozenset({"float16", "bfloat16"})}


def triton_16bit_reasons(fp32_reason: str) -> dict:
    """dtype_reasons of a 16-bit-only Triton kernel: the interpreter's bf16, and `fp32_reason` for fp32."""
    return {**TRITON_DTYPE_REASONS, ("cpu", "float32"): fp32_reason, ("cuda", "float32"): fp32_reason}
