"""Backend declarations: one `BackendSpec` per backend, tying kernels/ to the harness contract.

This package is the only place that imports both kernels/ and the harness contract. `BUILTINS` is the one
list of our backends; pyproject registers it under the entry-point group `moe_lora_harness.backends`, the
way a third-party package registers its own.
"""
if __name__ != "moe_lora_harness.backends":   # one name per module (a checkout's folder is not a second package)
    raise ImportError(f"{__name__!r} is the package moe_lora_harness.backends: import it by that name")

from moe_lora_harness.backends.dual_stream import BACKEND as _DUAL_STREAM
from moe_lora_harness.backends.eager import BACKEND as _EAGER
from moe_lora_harness.backends.experts import ALL as _EXPERTS
from moe_lora_harness.backends.layer import LAYERS as _LAYERS
from moe_lora_harness.backends.triton_op import ALL as _TRITON_OPS

BUILTINS = [_EAGER, *_TRITON_OPS, *_EXPERTS, _DUAL_STREAM, *_LAYERS]
