"""The FP8 (e4m3) schemes our kernels run, in one table: the activation group and the weight scale block of each
(docs/semantics.md 9.1), and the constants of e4m3 quantization. Torch-free so every kernel module may read it."""
from __future__ import annotations

E4M3_MAX = 448.0     # largest finite float8_e4m3fn; quantizers clamp to it before converting
AMAX_FLOOR = 1e-10   # a group's amax floor: a zero group quantizes to zeros, not 0/0
# scheme -> (activation group along K, None: one scale per row; weight scale block, None: one scale per channel)
FP8_SCHEMES = {"fp8_w8a8": (None, None), "fp8_block": (128, 128)}
ACTIVATION_GROUPS = {name: group for name, (group, _) in FP8_SCHEMES.items()}
WEIGHT_BLOCKS = {name: block for name, (_, block) in FP8_SCHEMES.items()}
# an FP8 GEMM's K tile (kernels.triton.fused_moe_gemm): each tile's e4m3 MMA starts from zero and is added to the fp32
# accumulator (a shorter K is one tile), so on sm_90 the accumulation is promoted every FP8_BLOCK_K products
# (backends.rounding declares it)
FP8_BLOCK_K = 128
