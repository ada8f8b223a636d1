"""Layer-level suites: stateful MoE+LoRA layers driven across calls (harness.layer_contract)."""
