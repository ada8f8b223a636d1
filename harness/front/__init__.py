"""What a user runs: the `moe-lora-harness` CLI (and its adapter command group) and the pytest plugin."""
