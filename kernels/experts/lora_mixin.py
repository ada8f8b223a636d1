"""`LoRAExpertsMixin`: turns LoRA on for an experts stage, adding the two deltas at spec 5's points.

`apply_w13_lora` runs after the base w13 GEMM and before the activation (x = original hidden states,
row = token, unweighted); `apply_w2_lora` after the base w2 GEMM and before moe_sum (x = activation
output, row = pair, weighted). Both call our Triton op (kernels.triton.lora_op); the LoRA alignment is
computed once and reused between the two. Everything arrives as arguments: no hidden state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_lora_harness.kernels.experts.lora_context import MoELoRAContext
from moe_lora_harness.kernels.triton import lora_op
from moe_lora_harness.kernels.triton.align import moe_lora_align_block_size
from moe_lora_harness.op_contract.validate import default_tuning

SPARSITY_FACTOR = 8      # naive block assignment when T*k*8 <= E_local * max_loras (vLLM's rule)


@dataclass(frozen=True)
class LoRAAlignment:
    """The LoRA op's routing metadata for one forward, shared by the w13 and w2 deltas.

    naive: sorted_token_ids/num_tokens_post_padded are None and expert_ids is the flat local ids (T*k,).
    sorted: (L, EM) / (L, EM/block) / (L,) from moe_lora_align_block_size with `block_size`.
    `path` is the op path the dispatch takes (one_shot, small_batch, two_kernel) = the rounding model.
    """

    naive: bool
    block_size: int
    sorted_token_ids: torch.Tensor | None
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor | None
    token_lora_mapping: torch.Tensor
    lora_ids: torch.Tensor
    num_active_loras: torch.Tensor
    adapter_enabled: torch.Tensor
    path: str


def lora_layout(num_pairs: int, local_num_experts: int, max_loras: int, rank: int, *, expert_map: bool,
                fully_sharded: bool) -> tuple[bool, str]:
    """(naive, path) the mixin uses: naive iff not fully sharded, no EP and T*k*8 <= E*L; path per the op."""
    naive = (not fully_sharded and not expert_map
             and num_pairs * SPARSITY_FACTOR <= local_num_experts * max_loras)
    return naive, lora_op.select_path(naive=naive, max_lora_rank=rank, num_pairs=num_pairs,
                                      fully_sharded=fully_sharded)


def align_block_size(num_pairs: int, local_num_experts: int) -> int:
    """Align block: 16 for sparse buckets, 64 when experts average >= 32 pairs (no effect on values)."""
    return 64 if num_pairs >= 32 * local_num_experts else 16


def expand_shared(ws: list, num_experts: int) -> list:
    """Shared factors (expert dim 1) as stride-0 views over the E local experts; others unchanged."""
    return [w.expand(w.shape[0], num_experts, *w.shape[2:]) if w.shape[1] == 1 and num_experts > 1 else w
            for w in ws]


def build_lora_alignment(ctx: MoELoRAContext, local_ids: torch.Tensor, *, expert_map: bool,
                         mapping: torch.Tensor | None = None, path: str | None = None) -> LoRAAlignment:
    """Alignment for `local_ids` (T, k) int32 LOCAL expert ids (-1 = non-local pair); no host sync.

    `mapping` (T,) overrides ctx.mapping (e.g. a permuted one); `path` forces the op path (default: the
    op's own dispatch). lora_ids lists every slot 0..L-1 (the align and kernels skip slots with no token
    or no adapter), so the metadata is built without reading the mapping on the host.
    """
    if not isinstance(local_ids, torch.Tensor) or local_ids.dim() != 2 or local_ids.dtype != torch.int32:
        raise TypeError(f"topk_ids must be a (T, k) int32 tensor of LOCAL expert ids; got "
                        f"{getattr(local_ids, 'dtype', type(local_ids).__name__)} {tuple(getattr(local_ids, 'shape', ()))}")
    T, k = (int(s) for s in local_ids.shape)
    E, L, R = ctx.local_num_experts, ctx.max_loras, ctx.max_lora_rank
    P = T * k
    naive, auto_path = lora_layout(P, E, L, R, expert_map=expert_map, fully_sharded=ctx.fully_sharded)
    path = path or auto_path
    if path not in lora_op.PATHS:
        raise ValueError(f"path must be one of {lora_op.PATHS} or None; got {path!r}")
    dev = local_ids.device
    mapping = ctx.mapping if mapping is None else mapping
    if not isinstance(mapping, torch.Tensor) or tuple(mapping.shape) != (T,) or mapping.dtype != torch.int32:
        raise ValueError(f"token_lora_mapping must be an int32 tensor of shape (T,)=({T},); got "
                         f"{getattr(mapping, 'dtype', None)} {tuple(getattr(mapping, 'shape', ()))}")
    lora_ids = torch.cat([torch.arange(L, dtype=torch.int32, device=dev),
                          torch.full((1,), -1, dtype=torch.int32, device=dev)])
    num_active = torch.tensor([L + 1], dtype=torch.int32)
    bs = align_block_size(P, E)
    if naive:
        return LoRAAlignment(True, bs, None, local_ids.reshape(-1).contiguous(), None, mapping, lora_ids,
                             num_active, ctx.adapter_enabled, path)
    max_pad = P * bs if P < E else P + E * (bs - 1)
    max_pad = max(max_pad, bs)
    max_blocks = -(-max_pad // bs)
    sorted_ids = torch.full((L, max_pad), P, dtype=torch.int32, device=dev)
    expert_ids = torch.full((L, max_blocks), -1, dtype=torch.int32, device=dev)
    ntpp = torch.zeros(L, dtype=torch.int32, device=dev)
    moe_lora_align_block_size(local_ids, mapping, E, bs, L, max_pad, max_blocks, sorted_ids, expert_ids, ntpp,
                              ctx.adapter_enabled, lora_ids, None)
    return LoRAAlignment(False, bs, sorted_ids, expert_ids, ntpp, mapping, lora_ids, num_active,
                         ctx.adapter_enabled, path)


def run_lora_op(y: torch.Tensor, x: torch.Tensor, lora_a: list, lora_b: list, topk_weights: torch.Tensor,
                align: LoRAAlignment, *, top_k: int, mul_routed_weight: bool, add_inputs: bool,
                fully_sharded: bool = False, offset: int = 0, collective=None) -> None:
    """One fused_moe_lora call with `align`'s metadata, on the path the alignment names (`collective`:
    the fully-sharded join, passed to the two-kernel path, the only one with a collective)."""
    extra = {"collective": collective} if (collective is not None and align.path == "two_kernel") else {}
    lora_op.ENTRY_POINTS[align.path](y, x, lora_a, lora_b, topk_weights, align.sorted_token_ids, align.expert_ids,
       align.num_tokens_post_padded, align.token_lora_mapping, int(lora_a[0].shape[2]), top_k, align.lora_ids,
       align.num_active_loras, align.adapter_enabled, **default_tuning(align.block_size),
       mul_routed_weight=mul_routed_weight,
       fully_sharded=fully_sharded, offset=offset, add_inputs=add_inputs, **extra)


def _collective(ctx: MoELoRAContext, which: str):
    """The op's collective hook for one delta: the context's lora_collective bound to w13 / w2, or None."""
    if not ctx.fully_sharded or ctx.lora_collective is None:
        return None
    return lambda cache: ctx.lora_collective(cache, which)


class LoRAExpertsMixin:
    """Mix into a FusedMoEExperts subclass (first in the bases) to support LoRA.

    Needs `self.config` (MoEConfig) for the activation (swigluoai re-interleave) and sizes.
    """

    @classmethod
    def supports_lora(cls) -> bool:
        """LoRA is supported by every class that mixes this in."""
        return True

    @classmethod
    def lora_path(cls, config, num_tokens: int, max_loras: int) -> str:
        """The LoRA op path (= rounding model: one_shot, small_batch, two_kernel) a T-token forward takes."""
        return lora_layout(num_tokens * config.top_k, config.E, max_loras, config.max_lora_rank,
                           expert_map=config.expert_map, fully_sharded=config.fully_sharded)[1]

    def lora_alignment(self, ctx: MoELoRAContext, topk_ids: torch.Tensor, *, expert_map: bool) -> LoRAAlignment:
        """The alignment both deltas reuse (computed once per forward)."""
        return build_lora_alignment(ctx, topk_ids, expert_map=expert_map)

    def apply_w13_lora(self, ctx: MoELoRAContext, *, y: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor, expert_map: bool = False, align: LoRAAlignment | None = None,
                       add_inputs: bool = True) -> LoRAAlignment:
        """y (T, k, N1) += w13 LoRA delta of x (T, H) (add_inputs=False: y = delta); returns the alignment.

        topk_ids are LOCAL ids (-1 = non-local). Two slices write [gate; up] at columns s*I; for
        swigluoai the delta is computed in split layout into zeros and re-interleaved into y.
        """
        if align is None:
            align = self.lora_alignment(ctx, topk_ids, expert_map=expert_map)
        E = ctx.local_num_experts
        a = expand_shared(ctx.w13_lora_a_stacked, E)
        b = expand_shared(ctx.w13_lora_b_stacked, E)
        _check_y(y, "y", topk_weights, sum(int(t.shape[2]) for t in b))
        k = int(topk_weights.shape[1])
        if self.config.activation == "swigluoai" and len(a) == 2:
            I = int(b[0].shape[2])
            # into zeros with add_inputs=True: rnd(0 + rnd(d)) = rnd(d), and valid under fully_sharded too
            delta = torch.zeros(y.shape[0], k, 2 * I, dtype=y.dtype, device=y.device)
            run_lora_op(delta, x, a, b, topk_weights, align, top_k=k, mul_routed_weight=False, add_inputs=True,
                        fully_sharded=ctx.fully_sharded, collective=_collective(ctx, "w13"))
            if add_inputs:
                y[..., 0::2] += delta[..., :I]
                y[..., 1::2] += delta[..., I:]
            else:
                y[..., 0::2] = delta[..., :I]
                y[..., 1::2] = delta[..., I:]
            return align
        run_lora_op(y, x, a, b, topk_weights, align, top_k=k, mul_routed_weight=False, add_inputs=add_inputs,
                    fully_sharded=ctx.fully_sharded, collective=_collective(ctx, "w13"))
        return align

    def apply_w2_lora(self, ctx: MoELoRAContext, *, y: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor,
                      align: LoRAAlignment, add_inputs: bool = True) -> None:
        """y (T, k, H) += w * w2 LoRA delta of x (T*k, I) (mul_routed_weight, reusing the w13 alignment).

        Fully sharded: this rank's B holds H/tp rows written at offset tp_rank * H/tp.
        """
        if not isinstance(align, LoRAAlignment):
            raise TypeError(f"align must be the LoRAAlignment apply_w13_lora returned; got {type(align).__name__}")
        E = ctx.local_num_experts
        a = expand_shared(ctx.w2_lora_a_stacked, E)
        b = expand_shared(ctx.w2_lora_b_stacked, E)
        _check_y(y, "y", topk_weights, None)
        offset = int(b[0].shape[2]) * ctx.tp_rank if ctx.fully_sharded else 0
        run_lora_op(y, x, a, b, topk_weights, align, top_k=int(topk_weights.shape[1]), mul_routed_weight=True,
                    add_inputs=add_inputs, fully_sharded=ctx.fully_sharded, offset=offset,
                    collective=_collective(ctx, "w2"))


def _check_y(y, name, topk_weights, width):
    if not isinstance(y, torch.Tensor) or y.dim() != 3 or tuple(y.shape[:2]) != tuple(topk_weights.shape):
        raise ValueError(f"{name} must be (T, k, N) matching topk_weights {tuple(topk_weights.shape)}; got "
                         f"{tuple(getattr(y, 'shape', ()))}")
    if width is not None and y.shape[2] != width:
        raise ValueError(f"{name} must be {width} wide (the w13 LoRA slices' total N); got {y.shape[2]}")
