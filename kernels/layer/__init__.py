"""Stateful MoE+LoRA layers: built once, then driven across batches (adapters, mappings, forwards, graphs).

Import the submodules directly (kernels.layer.stateful); this package keeps no state.
"""
