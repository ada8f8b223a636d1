"""The sign-of-zero failure: an op that writes +0.0 over a -0.0 the contract leaves untouched (an always-
accumulating op adds a zero delta to rows it must skip; SGLang's does, at 21 of 84 runs on the H200). The values
are equal, the bits are not: still a failure (untouched elements are compared bit for bit), but named for what it
is rather than as a semantic alternative that does not fit."""
from __future__ import annotations

import torch

from moe_lora_harness.harness.build.builders import torch_dtype
from moe_lora_harness.harness.judge.compare import compare_written, same_bits
from moe_lora_harness.harness.judge.expectation import Rules, judging
from moe_lora_harness.reference.precision import bound_dtype

SIGN_OF_ZERO = "sign-of-zero"


def sign_of_zero_text(n: int) -> str:
    """The diagnosis line for `n` changed untouched zeros."""
    return (f"only the sign of zero changed: the op writes elements the contract leaves untouched ({n} -0.0 "
            f"became +0.0, e.g. by adding a zero delta); values equal, written elements within the bound")


def sign_of_zero_only(case, backend_precision: str, output: torch.Tensor, truth, emulation,
                      before: torch.Tensor | None, rules: Rules = Rules()) -> int:
    """How many untouched elements changed only their sign of zero, when that is the output's whole fault: every
    untouched element that differs from `before` bit for bit is a zero equal in value, and with them put back the
    output passes the contract's judge (under the verdict's `rules`). 0 otherwise (or without `before`, the buffer as
    handed over)."""
    if before is None or output is None or truth is None:
        return 0
    written, k_plus_r, _ = judging(case, truth)
    out = output.detach().to(truth.value.device)
    b = before.detach().to(out.device, out.dtype)
    changed = ~written & ~same_bits(out, b)
    if not changed.any() or not bool(((out == 0) & (b == 0))[changed].all()):
        return 0
    restored = torch.where(written, out, b)      # the untouched elements as handed over
    dtype = torch_dtype(case)
    verdict = compare_written(restored, truth.value, emulation, truth.scale, written, before=b,
                              dtype=bound_dtype(backend_precision, dtype), k_plus_r=k_plus_r, work_dtype=dtype,
                              underflow=truth.underflow, **rules.kwargs(truth))
    return int(changed.sum()) if verdict.ok else 0
