"""`vllm_op`: an implementation over a validated `OpCall` becomes an entry point with vLLM 0.33.0's
`fused_moe_lora` signature, shared from `validate_call` rather than retyped."""
from __future__ import annotations

import functools
import inspect

from moe_lora_harness.op_contract.validate import SIGNATURE, validate_call


def vllm_op(impl):
    """Decorator: `impl(call, *, extra=...)` becomes `op(output, qcurr_hidden_states, ..., add_inputs=True, *,
    extra=...)`, which binds its arguments as vLLM's function does (positional or keyword), validates vLLM's into
    an OpCall and calls `impl(call, extra=...)`. inspect.signature(op) shows vLLM's parameters, then impl's
    keyword-only ones; impl's docstring and name are op's."""
    params = list(inspect.signature(impl).parameters.values())
    extras = params[1:]
    if not params or any(p.kind is not p.KEYWORD_ONLY for p in extras):
        raise TypeError(f"{impl.__qualname__} must take the OpCall, then keyword-only arguments only")
    clash = {p.name for p in extras} & set(SIGNATURE.parameters)
    if clash:
        raise TypeError(f"{impl.__qualname__}'s keyword-only arguments {sorted(clash)} are vLLM's parameters")
    vllm = tuple(SIGNATURE.parameters)
    own = tuple(p.name for p in extras)
    signature = SIGNATURE.replace(parameters=[*SIGNATURE.parameters.values(), *extras],
                                  return_annotation=inspect.signature(impl).return_annotation)

    @functools.wraps(impl)
    def op(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        return impl(validate_call(**{n: given[n] for n in vllm}), **{n: given[n] for n in own})

    op.__signature__ = signature
    return op
