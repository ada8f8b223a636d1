"""Pure-PyTorch float64 reference of vLLM 0.33.0's MoE + LoRA semantics (the harness's truth).

Imports only torch. Re-exports are chosen by the lead; import the submodules directly.
"""
if __name__ != "moe_lora_harness.reference":   # one name per module (a checkout's folder is not a second package)
    raise ImportError(f"{__name__!r} is the package moe_lora_harness.reference: import it by that name")
