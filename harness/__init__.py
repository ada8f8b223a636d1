"""moe-lora-harness: cases, strategies, backend contract, registry, comparison, runner and CLI.

The harness knows backends only through `harness.contract.BackendSpec` records.
"""
if __name__ != "moe_lora_harness.harness":   # one name per module (a checkout's folder is not a second package)
    raise ImportError(f"{__name__!r} is the package moe_lora_harness.harness: import it by that name")
