"""What Triton's CPU interpreter cannot compute, and which kernels a backend call launched in it.

Without CUDA, Triton kernels run in the interpreter (TRITON_INTERPRET=1), which computes bfloat16 on bit
patterns, not values (triton issue 11584). Our backends declare that; a wrapped third-party function cannot.
So every call is watched: a call that launched an interpreted kernel on a tensor of such a dtype produced no
verdict about the kernel, and the judge reports its case as not runnable on this machine (never a pass, never a
failure), whoever the backend is.
"""
from __future__ import annotations

import torch

from moe_lora_harness.harness.device import interpreting

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
    in Triton's interpreter (nothing where the interpreter is off: compiled kernels compute every dtype)."""

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
            return original(fn_self, *args, **kwargs)

        InterpretedFunction.run = run
        self._restore = lambda: setattr(InterpretedFunction, "run", original)
        return self

    def __exit__(self, *exc) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None


def cannot_run_here(launches) -> str:
    """Why a call's result says nothing about the kernel ('' when it does): an interpreted launch on a tensor
    of a dtype the interpreter cannot compute."""
    for dt, why in CANNOT_COMPUTE.items():
        kernels = sorted({name for name, dtypes in launches if dt in dtypes})
        if kernels:
            return (f"not runnable on this machine: Triton kernel(s) {', '.join(kernels[:4])} ran in the CPU "
                    f"interpreter on {str(dt).removeprefix('torch.')} tensors; {why}; run it on a GPU")
    return ""
