"""Our implementations of the MoE-LoRA op (eager torch and Triton); imports only torch and triton."""
if __name__ != "moe_lora_harness.kernels":   # one name per module (a checkout's folder is not a second package)
    raise ImportError(f"{__name__!r} is the package moe_lora_harness.kernels: import it by that name")
