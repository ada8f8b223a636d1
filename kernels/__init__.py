"""Our implementations of the MoE-LoRA op (eager torch and Triton); imports only torch and triton."""
if __name__ != "moe_lora_harness.kernels":   # one name per module (a checkout's folder is not a second package)
    # `kernels` is also Hugging Face's package, which transformers imports, or probes by importing it when no
    # distribution names it: from a checkout's root this folder shadows it. It steps aside for an installed
    # `kernels`; where there is none it reads as absent (no file, no version, no submodule: what such a probe
    # takes for "not installed") and any name used on it says which package this folder is.
    import importlib.machinery
    import importlib.util
    import os
    import sys
    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec(__name__, _elsewhere) if "." not in __name__ else None
    if _spec is not None and _spec.loader is not None:
        _installed = importlib.util.module_from_spec(_spec)
        sys.modules[__name__] = _installed          # what `import kernels` returns once this body ends
        _spec.loader.exec_module(_installed)
    else:
        _WHY = f"{__name__!r} is the package moe_lora_harness.kernels: import it by that name"
        if "." in __name__:
            raise ImportError(_WHY)
        __file__, __path__ = None, []

        def __getattr__(name: str):
            raise AttributeError(f"{_WHY} (no attribute {name!r} here)")
    del importlib, os, sys, _checkout, _elsewhere, _spec
