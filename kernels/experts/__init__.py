"""The modular expert layer: config, LoRA context and mixin, experts backends, and the oracle choosing one.

Import the submodules directly (kernels.experts.triton_experts, ...); this package keeps no state.
"""
