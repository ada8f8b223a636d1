"""Our implementations of the MoE-LoRA op (eager torch and Triton); imports only torch and triton."""
