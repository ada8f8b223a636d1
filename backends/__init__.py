"""Backend declarations: one `harness.contract.BackendSpec` per backend, tying kernels/ to the contract.

This package is the only place that imports both kernels/ and harness.contract. The harness loads these
records by "module:attr" reference (entry-point group `moe_lora_harness.backends`).
"""
