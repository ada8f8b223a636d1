"""vLLM 0.33.0's `fused_moe_lora` op contract in one place: its signature, its argument checks and the validated
call (`OpCall`). Imports only torch; reference/, kernels/ and harness/ read it. Import the submodules directly.
"""
if __name__ != "moe_lora_harness.op_contract":   # one name per module (a checkout's folder is not a second package)
    raise ImportError(f"{__name__!r} is the package moe_lora_harness.op_contract: import it by that name")
