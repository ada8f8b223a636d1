"""What Triton's CPU interpreter cannot compute, and which kernels a backend call launched in it.

Without CUDA, Triton kernels run in the interpreter (TRITON_INTERPRET=1), which computes bfloat16 on bit
patterns, not values (triton issue 11584). Our backends declare that; a wrapped third-party function cannot.
So every call is watched: a call that launched an interpreted kernel on a tensor of such a dtype produced no
verdict about the kernel, and the judge reports its case as not runnable on this machine (never a pass, never a
failure), whoever the backend is.

While a call is watched, the interpreter also computes integer arithmetic as compiled kernels do: Triton
compiles its overflow checks (sanitize_overflow) into nothing without debug=True, but the interpreter runs
them on every int32 add, sub and mul (and then drops their assert: its options have no debug), which cost a
quarter of the interpreted time of the suites' kernels
(measured: 40 triton_experts feature cases, 11.0 s with, 8.2 s without) for offsets far below 2**31. And a
@triton.jit helper called from a kernel does not patch triton.language again: the interpreter re-scans every
member of the language modules at each such call (never undoing it) although the launch has already patched
them, which was 11% of the CPU test suite's whole CPU time (py-spy, 2026-12-02). And Triton 3.6's interpreter
turns a scalar into an int in a way NumPy 2.4 refuses (every interpreted kernel with a runtime loop bound raised,
so a correct backend failed): a watched launch gets the conversion Triton 3.9 has. And the interpreter maps a
Triton dtype to NumPy's by building a table of 19 dtypes at every call (every load, store, cast and constant):
2.5% of the CPU suite's whole CPU time (py-spy, 2026-12-06); a watched launch reads the same answers from a memo.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from moe_lora_harness.harness.execution.device import interpreting

# dtype -> why the interpreter's result in it says nothing about the kernel (the one list of such limits)
CANNOT_COMPUTE = {
    torch.bfloat16: "Triton's interpreter computes bfloat16 on bit patterns, not values (triton issue 11584)",
}


def _tensor_dtypes(values) -> set:
    out = set()
    for v in values:
        if isinstance(v, torch.Tensor):
            out.add(v.dtype)
        elif isinstance(v, (list, tuple)):
            out |= _tensor_dtypes(v)
    return out


class LaunchWatch:
    """Within `with LaunchWatch() as w:`, `w.launches` lists (kernel name, tensor dtypes) of every kernel launched
    in Triton's interpreter (nothing where the interpreter is off: compiled kernels compute every dtype); the
    interpreter's overflow checks are off meanwhile (module doc)."""

    def __init__(self):
        self.launches: list = []
        self._restore = None

    def __enter__(self) -> "LaunchWatch":
        if not interpreting():
            return self
        from triton.runtime.interpreter import InterpretedFunction
        original = InterpretedFunction.run
        launches = self.launches

        def run(fn_self, *args, **kwargs):
            name = getattr(getattr(fn_self, "fn", None), "__name__", "kernel")
            launches.append((name, frozenset(_tensor_dtypes(args) | _tensor_dtypes(kwargs.values()))))
            outer = getattr(_LAUNCH, "state", None)
            _LAUNCH.state = {"langs": _lang_modules(fn_self.fn), "patched": False}
            try:
                return original(fn_self, *args, **kwargs)
            finally:
                _LAUNCH.state = outer

        InterpretedFunction.run = run
        restore_options = _as_compiled()
        restore_patch = _patch_once_per_launch()
        restore_dtypes = _memoized_np_dtype()
        self._restore = lambda: (setattr(InterpretedFunction, "run", original), restore_options(), restore_patch(),
                                 restore_dtypes())
        return self

    def __exit__(self, *exc) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None


def _as_compiled():
    """Turn the interpreter's integer-overflow checks off, as a compile without debug does; returns the undo
    (a no-op where this Triton keeps its options elsewhere)."""
    import dataclasses

    from triton.runtime import interpreter
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or not dataclasses.is_dataclass(options) or not hasattr(options, "sanitize_overflow"):
        return lambda: None
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return lambda: setattr(builder, "options", options)


def _memoized_np_dtype():
    """The interpreter's Triton-to-NumPy dtype map, memoized (module doc): the same answer for every dtype, a
    block's its element's, a pointer's uint64; returns the undo (a no-op where this Triton has no such function)."""
    import triton.language as tl
    from triton.runtime import interpreter
    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None:
        return lambda: None
    memo: dict = {}
    pointer = original(tl.pointer_type(tl.int8))

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):      # unhashable; the table reads its element type
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        got = memo.get(tt_dtype)
        if got is None:
            got = memo[tt_dtype] = original(tt_dtype)    # an unknown dtype raises as before
        return got

    interpreter._get_np_dtype = np_dtype
    return lambda: setattr(interpreter, "_get_np_dtype", original)


_LAUNCH = threading.local()   # .state: the watched launch in flight on this thread (its language modules)


def _lang_modules(fn) -> frozenset:
    """The triton.language modules a jit function's globals name (what the interpreter patches for it)."""
    import triton.language as tl
    return frozenset(id(v) for v in getattr(fn, "__globals__", {}).values() if v is tl or v is tl.core)


class _Unpatched:
    """The patch scope of a helper call inside a launch that has already patched its language modules."""

    def restore(self) -> None:
        pass


def _patch_once_per_launch():
    """Within a watched launch, a jit helper whose language modules the launch has patched skips the re-patch
    (module doc); returns the undo (a no-op where this Triton has no module-level `_patch_lang`)."""
    from triton.runtime import interpreter
    original = getattr(interpreter, "_patch_lang", None)
    if original is None:
        return lambda: None

    def patch_lang(fn):
        state = getattr(_LAUNCH, "state", None)
        langs = _lang_modules(fn)
        if state is not None and state["patched"] and langs <= state["langs"]:
            return _Unpatched()
        scope = original(fn)
        _index_of_one_element()
        if state is not None:   # the launch's own patch (before its first program), or a helper's that
            state["patched"] = True             # names another language module (never undone by Triton)
            state["langs"] = state["langs"] | langs
        return scope

    interpreter._patch_lang = patch_lang
    return lambda: setattr(interpreter, "_patch_lang", original)


def _one_element_index(self) -> int:
    """A scalar's int value: the interpreter holds scalars as 1-element arrays."""
    return int(np.asarray(self.handle.data).reshape(()))


def _index_of_one_element() -> None:
    """Triton 3.6's interpreter converts a scalar to int with int() of its 1-element array, which NumPy 2.4 refuses
    (3.9's squeezes it first): every kernel with a loop over a runtime bound raised, and a correct backend failed
    check. Patched with the language (each launch re-patches); where Triton squeezes it this changes nothing."""
    import triton.language as tl
    tl.core.tensor.__index__ = _one_element_index


def cannot_run_here(launches) -> str:
    """Why a call's result says nothing about the kernel ('' when it does): an interpreted launch on a tensor
    of a dtype the interpreter cannot compute."""
    for dt, why in CANNOT_COMPUTE.items():
        kernels = sorted({name for name, dtypes in launches if dt in dtypes})
        if kernels:
            return (f"not runnable on this machine: Triton kernel(s) {', '.join(kernels[:4])} ran in the CPU "
                    f"interpreter on {str(dt).removeprefix('torch.')} tensors; {why}; run it on a GPU")
    return ""
