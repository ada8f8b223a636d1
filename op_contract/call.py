"""The validated `fused_moe_lora` call (`OpCall`, what every implementation reads) and the error an argument the
op cannot take raises (`MoELoRAArgumentError`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


class MoELoRAArgumentError(ValueError, AssertionError):
    """An argument the MoE-LoRA op cannot take: a shape, size, stride, device, layout, id range or path condition.

    A ValueError, as Python reports a bad argument value; and an AssertionError too, because vLLM 0.33.0's
    fused_moe_lora checks the same conditions with `assert`, and its callers and tests expect that (vLLM's
    test wants an AssertionError naming shrink_block_size_m when the sorted layout gets a BLOCK_M that is
    not a power of two >= 16). As a drop-in, our op's argument errors satisfy `except ValueError` and
    `except AssertionError` alike. Wrong types and dtypes stay TypeError.
    """


@dataclass
class OpCall:
    """The validated tensors of one `fused_moe_lora` call and the sizes implementations read (ids are integer
    tensors, int32 in production; kernels/validate.py adds what our kernels need of their dtype and strides)."""

    output: torch.Tensor  # (T, k, W)
    x: torch.Tensor  # (T, K) or (T*k, K)
    lora_a: list  # S x (L, E|1, R, K), identical shapes
    lora_b: list  # S x (L, E|1, N, R'), identical shapes
    weights: torch.Tensor  # (T*k,) routing weights, flat over pairs
    sorted_token_ids: torch.Tensor | None  # (L, EM) or None (naive)
    expert_ids: torch.Tensor  # (L, EM/BM) sorted, (T*k,) naive
    num_tokens_post_padded: torch.Tensor | None  # (L,)
    token_lora_mapping: torch.Tensor  # (T,)
    lora_ids: torch.Tensor  # (>= num_active,)
    adapter_enabled: torch.Tensor  # (>= L,)
    num_tokens: int
    top_k: int
    num_slices: int
    max_loras: int
    experts_a: int
    experts_b: int
    rank: int  # A's rank rows (= max_lora_rank)
    rank_b: int  # B's rank columns (= rank, or the gathered rank under fully_sharded w13)
    hidden: int  # K
    n_out: int  # N per slice
    offset: int
    block_m: int  # align block size (shrink_block_size_m)
    num_active: int  # sorted-mode grid size over lora_ids
    mul_routed_weight: bool
    add_inputs: bool
    fully_sharded: bool

    @property
    def num_pairs(self) -> int:
        """T * k, the flat pair count (also the pad value of sorted_token_ids)."""
        return self.num_tokens * self.top_k

    @property
    def naive(self) -> bool:
        """True for naive block assignment (sorted_token_ids is None)."""
        return self.sorted_token_ids is None

    @property
    def em(self) -> int:
        """Padded length of one LoRA's sorted ids (0 in naive mode)."""
        return 0 if self.sorted_token_ids is None else int(self.sorted_token_ids.shape[1])

    @property
    def num_experts(self) -> int:
        """Local expert count implied by the weights (1 when every factor is shared)."""
        return max(self.experts_a, self.experts_b)

    @property
    def x_row_div(self) -> int:
        """x row of pair p is p // x_row_div: 1 with mul_routed_weight (x is (T*k, K)), else k."""
        return 1 if self.mul_routed_weight else self.top_k
