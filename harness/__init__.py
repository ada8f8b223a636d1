"""moe-lora-harness: cases, strategies, backend contract, registry, comparison, runner and CLI.

The harness knows backends only through `harness.contract.BackendSpec` records.
"""
