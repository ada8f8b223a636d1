"""The pytest suites, shipped in the package: `pytest --pyargs moe_lora_harness.suites --moe-lora-backend MOD:ATTR`."""
