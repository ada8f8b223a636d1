"""moe-lora-harness: a conformance harness for Mixture-of-Experts + LoRA kernels (vLLM 0.33.0 semantics).

One import package holds everything: `moe_lora_harness.reference` (the float64 truth),
`moe_lora_harness.kernels` (our kernels), `moe_lora_harness.harness` (cases, contract, runner, CLI),
`moe_lora_harness.backends` (our backends' declarations) and `moe_lora_harness.suites` (the pytest suites).
In the repository those are the top-level folders; the build maps them into this namespace.
"""
from __future__ import annotations

import os as _os

__version__ = "0.2.0"

# A source tree run without installing (e.g. PYTHONPATH=. on a GPU box): the subpackages are the folders
# beside this one, so look for them there. An installed copy has them inside and skips this.
_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if (not _os.path.isdir(_os.path.join(_here, "harness"))
        and _os.path.isfile(_os.path.join(_root, "harness", "contract.py"))):
    __path__.append(_root)  # type: ignore[name-defined]  # noqa: F821
