"""The benchmark shapes every bench script shares (issue 3's list): models and token counts."""

MODELS = {  # name: (H, I, E, top_k)
    "qwen3moe": (2048, 768, 128, 8),
    "mixtral": (4096, 14336, 8, 2),
    "gptoss20b": (2880, 2880, 32, 4),
}
T_ALL = (1, 16, 128, 1024, 4096)
