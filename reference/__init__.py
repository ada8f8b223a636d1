"""Pure-PyTorch float64 reference of vLLM 0.33.0's MoE + LoRA semantics (the harness's truth).

Imports only torch. Re-exports are chosen by the lead; import the submodules directly.
"""
