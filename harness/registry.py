"""Backend registry: built-ins and third-party backends, all loaded from "module:attr" references.

Sources, in order: the entry-point group `moe_lora_harness.backends` (our own built-ins are declared
there too), the built-in references below when running from a source checkout that is not installed,
and any `--backend module:attr` given on the command line. `module:attr` may name a BackendSpec, a list
of them, a zero-argument factory, or a plain function with vLLM 0.33.0's `fused_moe_lora` signature,
which is wrapped as an op-level backend.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
from importlib import metadata

from harness.case import Case
from harness.contract import BackendSpec, Capabilities

ENTRY_POINT_GROUP = "moe_lora_harness.backends"

BUILTIN_REFS = (
    "backends.eager:BACKEND",
    "backends.triton_op:TRITON",
    "backends.triton_op:TRITON_ONE_SHOT",
    "backends.triton_op:TRITON_ONE_SHOT_SPLIT_K",
    "backends.triton_op:TRITON_ONE_SHOT_STREAM",
    "backends.triton_op:TRITON_SMALL_BATCH",
    "backends.triton_op:TRITON_TWO_KERNEL",
    "backends.experts:TRITON_EXPERTS",
    "backends.experts:GATED_FAST_EXPERTS",
    "backends.experts:OAI_EXPERTS",
    "backends.experts:MARLIN_EXPERTS",
    "backends.experts:EXPERTS_ORACLE",
    "backends.dual_stream:BACKEND",
)

# The leading parameters of vLLM 0.33.0's fused_moe_lora, used to recognise a plain op function.
FUSED_MOE_LORA_PARAMS = (
    "output", "qcurr_hidden_states", "lora_a_stacked", "lora_b_stacked", "topk_weights",
    "sorted_token_ids", "expert_ids", "num_tokens_post_padded", "token_lora_mapping",
    "max_lora_rank", "top_k_num", "lora_ids", "num_active_loras", "adapter_enabled",
)


class BackendLoadError(ValueError):
    """A backend reference could not be loaded; the message says which and why."""


def vllm_dispatch_precision(case: Case) -> str:
    """Rounding model of the path vLLM 0.33.0's dispatch takes for this case (spec 1.3)."""
    if (not case.fully_sharded and case.max_rank <= 128 and case.layout == "naive"
            and case.max_rank <= 64 and case.T * case.top_k * case.max_rank <= 1024):
        return "small_batch"
    if not case.fully_sharded and case.max_rank <= 128:
        return "one_shot"
    return "two_kernel"


def looks_like_fused_moe_lora(fn) -> bool:
    """True if `fn`'s parameters start like vLLM 0.33.0's fused_moe_lora."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return tuple(params[:len(FUSED_MOE_LORA_PARAMS)]) == FUSED_MOE_LORA_PARAMS


def wrap_op_function(fn, name: str) -> BackendSpec:
    """An op-level backend around a plain fused_moe_lora-signature function; it claims every op case."""
    return BackendSpec(
        name=name,
        description=f"plain fused_moe_lora function {name} (claims every op-level case; rounding model "
                    f"follows vLLM 0.33.0's dispatch)",
        capabilities=Capabilities(levels=frozenset({"op"})),
        op=fn, precision=vllm_dispatch_precision, origin=name)


def load_ref(ref: str) -> list[BackendSpec]:
    """Load "module:attr" (or "path/to/file.py:attr") into one or more BackendSpecs."""
    if ":" not in ref:
        raise BackendLoadError(f"--backend {ref!r}: expected 'module:attr' (e.g. mypkg.moe:fused_moe_lora)")
    mod_name, attr = ref.rsplit(":", 1)
    try:
        if mod_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(f"_mlh_user_{abs(hash(mod_name))}", mod_name)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - report any import failure with its cause
        raise BackendLoadError(f"--backend {ref!r}: cannot import {mod_name!r}: {type(e).__name__}: {e}") from e
    try:
        obj = getattr(mod, attr)
    except AttributeError:
        raise BackendLoadError(f"--backend {ref!r}: module {mod_name!r} has no attribute {attr!r}") from None
    return _as_specs(obj, ref)


def _as_specs(obj, ref: str) -> list[BackendSpec]:
    if isinstance(obj, BackendSpec):
        return [obj if obj.origin else dataclasses.replace(obj, origin=ref)]
    if isinstance(obj, (list, tuple)) and all(isinstance(o, BackendSpec) for o in obj):
        return [o if o.origin else dataclasses.replace(o, origin=ref) for o in obj]
    if callable(obj):
        if looks_like_fused_moe_lora(obj):
            return [wrap_op_function(obj, ref)]
        try:
            sig = inspect.signature(obj)
            zero_arg = all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                           for p in sig.parameters.values())
        except (TypeError, ValueError):
            zero_arg = False
        if zero_arg:
            return _as_specs(obj(), ref)
    raise BackendLoadError(
        f"--backend {ref!r}: expected a BackendSpec, a list of them, a zero-argument factory, or a function "
        f"whose parameters start with {FUSED_MOE_LORA_PARAMS[:4]}...; got {type(obj).__name__}")


def entry_point_refs() -> list[str]:
    """'module:attr' strings registered under the entry-point group by installed distributions."""
    try:
        eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    except TypeError:  # Python < 3.10 API
        eps = metadata.entry_points().get(ENTRY_POINT_GROUP, [])
    return [ep.value for ep in eps]


def available_backends(extra_refs=(), include_builtin=True) -> dict[str, BackendSpec]:
    """Every backend by name: entry points, built-ins (when not installed) and `extra_refs`.

    A reference that fails to load is an error, not a silent omission.
    """
    refs = []
    if include_builtin:
        refs += entry_point_refs()
        refs += [r for r in BUILTIN_REFS if r not in refs]
    refs += [r for r in extra_refs if r not in refs]
    out: dict[str, BackendSpec] = {}
    for ref in refs:
        for spec in load_ref(ref):
            if spec.name in out and out[spec.name] is not spec:
                if out[spec.name].origin == spec.origin:
                    continue
                raise BackendLoadError(f"two backends are named {spec.name!r} ({out[spec.name].origin or '?'} "
                                       f"and {spec.origin or ref}); rename one")
            out[spec.name] = spec
    return out
