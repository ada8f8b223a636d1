"""Layer-level suites: stateful MoE+LoRA layers driven across calls (harness.spec.layer_contract)."""
