"""The pure-PyTorch eager backend: torch ops in the working dtype, no Triton, every device and dtype."""
from harness.contract import BackendSpec, Capabilities
from kernels import eager

BACKEND = BackendSpec(
    name="eager",
    description="pure-PyTorch eager op (one-shot rounding points, loops over (LoRA, expert) groups)",
    capabilities=Capabilities(levels=frozenset({"op"})),
    op=eager.fused_moe_lora,
    precision="one_shot",
    origin="backends.eager:BACKEND",
)
