"""`python -m moe_lora_harness ...` is the `moe-lora-harness` command."""
import sys

from moe_lora_harness.harness.front.cli import main

sys.exit(main())
