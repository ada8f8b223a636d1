"""An example layer-level moe-lora-harness backend: a stranger's MoE+LoRA layer (layer.py, pure PyTorch, no
harness import) and the wrapper that drives it through the harness's layer methods (harness_adapter.py)."""
from vllm_style_layer.layer import ACTIVATIONS, MoELoRALayer

__all__ = ["ACTIVATIONS", "MoELoRALayer"]
