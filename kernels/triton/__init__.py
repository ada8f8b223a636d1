"""Triton MoE-LoRA kernels: one-shot, small-batch and two-kernel paths, the LoRA align, and dispatch.

Public entry points live in `kernels.triton.lora_op` (the op) and `kernels.triton.align` (the align);
this package module imports nothing so that TRITON_INTERPRET can still be set before the kernels load.
"""
