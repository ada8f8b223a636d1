"""The pytest suites, shipped in the package: `pytest --pyargs moe_lora_harness.suites --moe-lora-backend MOD:ATTR`."""
if __name__ != "moe_lora_harness.suites":   # one name per module (a checkout's folder is not a second package)
    raise ImportError(f"{__name__!r} is the package moe_lora_harness.suites: run pytest from the repository root, with test paths under src/moe_lora_harness/suites/, or --pyargs moe_lora_harness.suites")
