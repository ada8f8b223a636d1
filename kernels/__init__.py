"""Our implementations of the MoE-LoRA op (eager torch and Triton); imports only torch and triton."""
if __name__ != "moe_lora_harness.kernels":   # one name per module (a checkout's folder is not a second package)
    # `kernels` is also Hugging Face's package, which transformers >= 5 requires and imports: from a checkout's root
    # this folder shadows it, so it steps aside for an installed `kernels` and refuses only where there is none
    import importlib.machinery
    import importlib.util
    import os
    import sys
    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec(__name__, _elsewhere) if "." not in __name__ else None
    if _spec is None or _spec.loader is None:
        raise ImportError(f"{__name__!r} is the package moe_lora_harness.kernels: import it by that name")
    _installed = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _installed          # what `import kernels` returns once this body ends
    _spec.loader.exec_module(_installed)
