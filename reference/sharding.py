"""Tensor / expert parallelism of the MoE + LoRA layer, simulated on one process (spec 3, 4.1).

Slicing of base and LoRA weights per TP rank (plain and fully-sharded LoRA) and per EP rank, the
collectives as plain functions over per-rank tensor lists, the naive all-gather EP dispatch/combine,
and `sharded_experts_forward`, which runs the expert reference per simulated rank and recombines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import Tensor

from moe_lora_harness.reference.accumulation import dot_variance
from moe_lora_harness.reference.activations import lookup_activation
from moe_lora_harness.reference.adapters import StackedMoELoRA
from moe_lora_harness.reference.experts import (
    ExpertExpected, LoRACollectives, LoRAInputs, forward_steps, moe_experts_forward,
)
from moe_lora_harness.reference.precision import Precision, rnd, spacing_sq
from moe_lora_harness.reference.semantics import CONTRACT, Semantics

__all__ = [
    "tp_slice_base", "tp_slice_lora", "ep_expert_map", "ep_slice_lora", "ep_slice_base",
    "all_gather_last", "all_reduce_sum", "ep_dispatch", "ep_combine", "sharded_experts_forward",
]


def _check_parallel(size_name: str, size: int, rank_name: str, rank: int) -> None:
    """Validate a (world size, rank) pair, naming the arguments."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{size_name} must be an int >= 1, got {size!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < size:
        raise ValueError(f"{rank_name} must be an int in [0, {size_name}={size}), got {rank!r}")


def _shard(n: int, size: int, what: str) -> int:
    """n / size, or ValueError naming `what` when it does not divide."""
    if n % size:
        raise ValueError(f"{what}={n} is not divisible by the parallel size {size}")
    return n // size


# ----------------------------------------------------------------------------------------------
# Tensor parallelism
# ----------------------------------------------------------------------------------------------

def tp_slice_base(
    w13: Tensor,
    w2: Tensor,
    tp_size: int,
    tp_rank: int,
    gated: bool,
    w13_bias: Tensor | None = None,
    w2_bias: Tensor | None = None,
    *,
    interleaved: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """This TP rank's base weights: w13 rows and w2 columns sharded on the intermediate dim I.

    Gated split layout [gate(I); up(I)]: each half is sliced and the halves re-joined, so the rank
    holds [gate shard; up shard]. Interleaved layout (swigluoai, rows g0,u0,g1,u1,..): the rank's
    (g_i, u_i) rows are contiguous, rows [2*rank*I/tp, 2*(rank+1)*I/tp). w13_bias follows w13.
    w2_bias is kept only on rank 0 and zero elsewhere, so the final all-reduce adds it exactly once
    (a zero bias leaves the GEMM value unchanged, so ranks > 0 stay bit-identical to "no bias").
    Returns (w13, w2, w13_bias, w2_bias).
    """
    _check_parallel("tp_size", tp_size, "tp_rank", tp_rank)
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 must be (E, N1, H) and w2 (E, H, I); got {tuple(w13.shape)} and {tuple(w2.shape)}")
    E, N1, H = w13.shape
    I = int(w2.shape[2])
    if tuple(w2.shape[:2]) != (E, H):
        raise ValueError(f"w2 must have shape (E={E}, H={H}, I), got {tuple(w2.shape)}")
    if N1 != (2 * I if gated else I):
        raise ValueError(f"w13 dim 1 must be {'2*I' if gated else 'I'}={2 * I if gated else I} for "
                         f"gated={gated}, got {N1}")
    if interleaved and not gated:
        raise ValueError("interleaved=True needs gated=True (interleaved rows are gate/up pairs)")
    if w13_bias is not None and tuple(w13_bias.shape) != (E, N1):
        raise ValueError(f"w13_bias must have shape (E={E}, N1={N1}), got {tuple(w13_bias.shape)}")
    if w2_bias is not None and tuple(w2_bias.shape) != (E, H):
        raise ValueError(f"w2_bias must have shape (E={E}, H={H}), got {tuple(w2_bias.shape)}")
    shard = _shard(I, tp_size, "intermediate size I")
    lo, hi = tp_rank * shard, (tp_rank + 1) * shard

    def rows(t: Tensor) -> Tensor:  # slice dim 1 (rows of w13 / entries of its bias)
        if not gated:
            return t[:, lo:hi].clone()
        if interleaved:
            return t[:, 2 * lo:2 * hi].clone()
        return torch.cat([t[:, lo:hi], t[:, I + lo:I + hi]], dim=1)

    w13_r = rows(w13)
    w2_r = w2[:, :, lo:hi].clone()
    b13_r = rows(w13_bias) if w13_bias is not None else None
    b2_r = None
    if w2_bias is not None:
        b2_r = w2_bias.clone() if tp_rank == 0 else torch.zeros_like(w2_bias)
    return w13_r, w2_r, b13_r, b2_r


def tp_slice_lora(stacked: StackedMoELoRA, tp_size: int, tp_rank: int, fully_sharded: bool) -> StackedMoELoRA:
    """This TP rank's LoRA buffers per spec 4.1 `set_lora` step 3 (from the unsharded buffers).

    w13_a: rank dim sliced only when fully_sharded; w13_b: output dim I always (tp > 1);
    w2_a: input dim I always; w2_b: H dim (offset tp_rank*H/tp) only when fully_sharded.
    Shared (expert-dim 1) factors are sliced the same way. tp_size 1 returns a copy.
    """
    _check_parallel("tp_size", tp_size, "tp_rank", tp_rank)
    if tp_size == 1:
        return stacked.clone()
    R = stacked.max_rank
    I = int(stacked.w13_b[0].shape[2])
    H = int(stacked.w2_b[0].shape[2])
    if int(stacked.w13_a[0].shape[2]) != R or int(stacked.w2_a[0].shape[3]) != I:
        raise ValueError("stacked must be the unsharded buffers (w13_a rank == w2_a rank, w2_a in == w13_b out)")
    shard = _shard(I, tp_size, "intermediate size I")
    i0, i1 = tp_rank * shard, (tp_rank + 1) * shard
    if fully_sharded:
        rs = _shard(R, tp_size, "max_rank R (fully_sharded slices the w13 A rank dim)")
        hs = _shard(H, tp_size, "hidden size H (fully_sharded slices the w2 B H dim)")
        w13_a = [a[:, :, tp_rank * rs:(tp_rank + 1) * rs, :].clone() for a in stacked.w13_a]
        w2_b = [b[:, :, tp_rank * hs:(tp_rank + 1) * hs, :].clone() for b in stacked.w2_b]
    else:
        w13_a = [a.clone() for a in stacked.w13_a]
        w2_b = [b.clone() for b in stacked.w2_b]
    w13_b = [b[:, :, i0:i1, :].clone() for b in stacked.w13_b]
    w2_a = [a[:, :, :, i0:i1].clone() for a in stacked.w2_a]
    return StackedMoELoRA(w13_a, w13_b, w2_a, w2_b, stacked.adapter_enabled.clone())


# ----------------------------------------------------------------------------------------------
# Expert parallelism
# ----------------------------------------------------------------------------------------------

def ep_expert_map(num_experts_global: int, ep_size: int, ep_rank: int, *, allow_uneven: bool = False,
                  device: torch.device | str | None = None) -> Tensor:
    """int32 (E_global,) map global expert id -> local id on `ep_rank`, -1 where not local (on `device`; None: CPU).

    Linear split as vLLM's `determine_expert_map("linear")`: rank r owns experts from
    r*base + min(r, remainder). With LoRA the adapter slicing keeps [r*E/ep, (r+1)*E/ep), which
    agrees only when E % ep == 0, so an uneven split raises unless `allow_uneven` (base only).
    """
    _check_parallel("ep_size", ep_size, "ep_rank", ep_rank)
    if not isinstance(num_experts_global, int) or num_experts_global < ep_size:
        raise ValueError(f"num_experts_global must be an int >= ep_size={ep_size}, got {num_experts_global!r}")
    base, rem = divmod(num_experts_global, ep_size)
    if rem and not allow_uneven:
        raise ValueError(
            f"num_experts_global={num_experts_global} is not divisible by ep_size={ep_size}: the linear expert "
            "map (rank r starts at r*base+min(r,remainder)) then differs from the LoRA expert slicing "
            "(spec 4.1 'uneven split caveat'); pass allow_uneven=True only for base weights without LoRA")
    start = ep_rank * base + min(ep_rank, rem)
    count = base + (1 if ep_rank < rem else 0)
    emap = torch.full((num_experts_global,), -1, dtype=torch.int32, device=device)
    emap[start:start + count] = torch.arange(count, dtype=torch.int32, device=device)
    return emap


def _ep_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """[start, end) of the experts owned by `ep_rank` (even split required)."""
    _check_parallel("ep_size", ep_size, "ep_rank", ep_rank)
    n = _shard(num_experts, ep_size, "number of experts E")
    return ep_rank * n, (ep_rank + 1) * n


def ep_slice_lora(stacked: StackedMoELoRA, ep_size: int, ep_rank: int) -> StackedMoELoRA:
    """This EP rank's LoRA buffers: experts [rank*E/ep, (rank+1)*E/ep) of every per-expert factor.

    Shared (expert-dim 1) factors are kept whole, as `_slice_moe_lora_ep` does.
    """
    lo, hi = _ep_range(stacked.num_experts, ep_size, ep_rank)

    def cut(t: Tensor) -> Tensor:
        return t.clone() if t.shape[1] == 1 and stacked.num_experts > 1 else t[:, lo:hi].clone()

    return StackedMoELoRA([cut(t) for t in stacked.w13_a], [cut(t) for t in stacked.w13_b],
                          [cut(t) for t in stacked.w2_a], [cut(t) for t in stacked.w2_b],
                          stacked.adapter_enabled.clone())


def ep_slice_base(
    w13: Tensor, w2: Tensor, biases: tuple[Tensor | None, Tensor | None] = (None, None),
    ep_size: int = 1, ep_rank: int = 0,
) -> tuple[Tensor, Tensor, tuple[Tensor | None, Tensor | None]]:
    """This EP rank's base weights (and biases): the experts of the linear even split."""
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0]:
        raise ValueError(f"w13 (E, N1, H) and w2 (E, H, I) must share E; got {tuple(w13.shape)}, {tuple(w2.shape)}")
    lo, hi = _ep_range(int(w13.shape[0]), ep_size, ep_rank)
    b13, b2 = biases
    return (w13[lo:hi].clone(), w2[lo:hi].clone(),
            (None if b13 is None else b13[lo:hi].clone(), None if b2 is None else b2[lo:hi].clone()))


# ----------------------------------------------------------------------------------------------
# Collectives (plain functions over per-rank lists)
# ----------------------------------------------------------------------------------------------

def _check_parts(parts: Sequence[Tensor], what: str) -> None:
    """Non-empty list of tensors sharing every dim but (for gathers) the last."""
    if len(parts) == 0 or not all(isinstance(p, Tensor) for p in parts):
        raise ValueError(f"{what}: parts must be a non-empty sequence of tensors, one per rank")


def all_gather_last(parts: Sequence[Tensor]) -> Tensor:
    """All-gather along the last dim: concatenation in rank order (what every rank receives)."""
    _check_parts(parts, "all_gather_last")
    lead = {tuple(p.shape[:-1]) for p in parts}
    if len(lead) != 1:
        raise ValueError(f"all_gather_last: parts must agree on all but the last dim, got {sorted(lead)}")
    return torch.cat(list(parts), dim=-1)


def all_reduce_sum(parts: Sequence[Tensor], dtype: torch.dtype | None = None) -> Tensor:
    """All-reduce (sum) in float64, in rank order; rounded to `dtype` once when given.

    A real NCCL reduction in bf16/fp16 rounds partial sums in an order of its own; the float64 sum
    is the truth and `dtype` gives a one-rounding model of the result.
    """
    _check_parts(parts, "all_reduce_sum")
    shapes = {tuple(p.shape) for p in parts}
    if len(shapes) != 1:
        raise ValueError(f"all_reduce_sum: parts must share one shape, got {sorted(shapes)}")
    total = torch.zeros(parts[0].shape, dtype=torch.float64, device=parts[0].device)
    for p in parts:
        total = total + p.to(torch.float64)
    if dtype is not None:
        total = rnd(total, dtype)
    return total


def ep_dispatch(
    hidden_per_rank: Sequence[Tensor],
    topk_w_per_rank: Sequence[Tensor],
    topk_ids_per_rank: Sequence[Tensor],
    mapping_per_rank: Sequence[Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, list[int]]:
    """Naive all-gather EP dispatch: every rank receives every rank's tokens, in rank order.

    The token->LoRA mapping travels beside the hidden states (MoEPrepareAndFinalizeNaiveDPEPModular),
    so row t of the gathered hidden states keeps its own adapter. Returns (hidden, topk_weights,
    topk_ids (global ids), mapping or None, tokens_per_rank).
    """
    n = len(hidden_per_rank)
    if n == 0 or len(topk_w_per_rank) != n or len(topk_ids_per_rank) != n or (
            mapping_per_rank is not None and len(mapping_per_rank) != n):
        raise ValueError("ep_dispatch: hidden/topk_w/topk_ids(/mapping)_per_rank must be non-empty lists "
                         "of equal length")
    counts = [int(h.shape[0]) for h in hidden_per_rank]
    for r in range(n):
        if topk_w_per_rank[r].shape[0] != counts[r] or topk_ids_per_rank[r].shape[0] != counts[r] or (
                mapping_per_rank is not None and mapping_per_rank[r].shape[0] != counts[r]):
            raise ValueError(f"ep_dispatch: rank {r}'s topk_w/topk_ids/mapping must have {counts[r]} rows "
                             "like its hidden states")
    hidden = torch.cat(list(hidden_per_rank), dim=0)
    w = torch.cat(list(topk_w_per_rank), dim=0)
    ids = torch.cat(list(topk_ids_per_rank), dim=0)
    mapping = None if mapping_per_rank is None else torch.cat(list(mapping_per_rank), dim=0)
    return hidden, w, ids, mapping, counts


def ep_combine(per_rank_outputs: Sequence[Tensor], tokens_per_rank: Sequence[int],
               dtype: torch.dtype | None = None) -> list[Tensor]:
    """Naive EP combine (reduce-scatter): sum the ranks' partial outputs (rounded to `dtype` once when
    given), split rows back by source rank."""
    total = all_reduce_sum(per_rank_outputs, dtype)
    if sum(tokens_per_rank) != total.shape[0]:
        raise ValueError(f"ep_combine: tokens_per_rank sums to {sum(tokens_per_rank)} but outputs have "
                         f"{total.shape[0]} rows")
    return list(torch.split(total, list(tokens_per_rank), dim=0))


# ----------------------------------------------------------------------------------------------
# Sharded forward
# ----------------------------------------------------------------------------------------------

def _in_lockstep(ranks: list, collectives: LoRACollectives) -> list:
    """Run the simulated ranks' `forward_steps` generators phase by phase, in one thread: every rank to its
    next join, then that join's collective over the ranks' partials (in rank order) sent back to each; the
    ranks' results."""
    results: list = [None] * len(ranks)
    sends: list = [None] * len(ranks)
    while True:
        asks = []
        for r, steps in enumerate(ranks):
            try:
                asks.append(steps.send(sends[r]))
            except StopIteration as done:
                asks.append(None)
                results[r] = done.value
        if all(a is None for a in asks):
            return results
        which = {a[0] if a is not None else None for a in asks}
        if len(which) != 1:
            raise RuntimeError(f"the simulated TP ranks reached different joins: {[a and a[0] for a in asks]}")
        joined = getattr(collectives, which.pop())([a[1] for a in asks])
        sends = [joined] * len(ranks)


def sharded_experts_forward(
    hidden: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    activation: str,
    precision: Precision,
    w13_bias: Tensor | None = None,
    w2_bias: Tensor | None = None,
    lora: LoRAInputs | None = None,
    tp_size: int = 1,
    ep_size: int = 1,
    fully_sharded: bool = False,
    apply_router_weight_on_input: bool = False,
    tokens_per_rank: Sequence[int] | None = None,
    w13_gather: Callable[[Sequence[Tensor]], Tensor] = all_gather_last,
    magnitudes: bool = True,
    semantics: Semantics = CONTRACT,
):
    """The expert forward on `tp_size` x `ep_size` simulated ranks, recombined with the collectives.

    Inputs are the unsharded layer (global experts, unsharded LoRA in `lora`, a LoRAInputs).
    TP: each rank gets every token and its weight shards; partial outputs are all-reduced. With
    `fully_sharded` the LoRA shrink outputs are joined between shrink and expand (w13: `w13_gather`
    over the rank dim, all_gather_last by default; w2: all_reduce) and the w2 expand writes H/tp
    columns at tp_rank*H/tp. EP: tokens split by `tokens_per_rank` (default: as even as possible),
    dispatched by all-gather with their LoRA mapping, each rank runs its local experts (global ids
    mapped by its expert_map), and the partial outputs are reduce-scattered back. The final
    reduction of the dt partial outputs is modelled as one rounding of their float64 sum (NCCL's own
    order is not). Returns an ExpertExpected for all tokens in the original order (value and scale
    summed over ranks; caches None). In float64 it equals `moe_experts_forward` on the unsharded
    layer up to summation order. magnitudes=False: the value only (scale and underflow None); `semantics`:
    as in forward_steps (every rank makes the same mistake).
    """
    for nm, v in (("tp_size", tp_size), ("ep_size", ep_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{nm} must be an int >= 1, got {v!r}")
    if tp_size > 1 and ep_size > 1:
        raise ValueError("tp_size > 1 together with ep_size > 1 is not modelled (under EP vLLM's MoE TP size is 1)")
    if fully_sharded and ep_size > 1:
        raise ValueError("fully_sharded=True with ep_size > 1: vLLM rejects EP with fully_sharded_loras")
    if fully_sharded and lora is None:
        raise ValueError("fully_sharded=True needs lora (it only changes how the LoRA is sharded)")
    if lora is not None and not isinstance(lora, LoRAInputs):
        raise TypeError(f"lora must be a LoRAInputs or None, got {type(lora).__name__}")
    spec = lookup_activation(activation)
    interleaved, gated = spec.interleaved, spec.gated
    common = dict(activation=activation, precision=precision,
                  apply_router_weight_on_input=apply_router_weight_on_input, magnitudes=magnitudes,
                  semantics=semantics)

    if ep_size > 1:
        return _ep_forward(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, lora, ep_size,
                           tokens_per_rank, common)

    if tp_size == 1:
        return moe_experts_forward(hidden, w13, w2, topk_weights, topk_ids, w13_bias=w13_bias, w2_bias=w2_bias,
                                   lora=lora, **common)

    group = LoRACollectives(w13=w13_gather, w2=all_reduce_sum)   # over every rank's partial

    def rank_steps(rank: int):
        w13_r, w2_r, b13_r, b2_r = tp_slice_base(w13, w2, tp_size, rank, gated, w13_bias, w2_bias,
                                                 interleaved=interleaved)
        lora_r = None
        coll = None
        offset = 0
        if lora is not None:
            lora_r = replace(lora, stacked=tp_slice_lora(lora.stacked, tp_size, rank, fully_sharded))
            if fully_sharded:
                coll = group
                offset = rank * int(lora_r.stacked.w2_b[0].shape[2])
        return forward_steps(hidden, w13_r, w2_r, topk_weights, topk_ids, w13_bias=b13_r, w2_bias=b2_r,
                             lora=lora_r, lora_collectives=coll, w2_lora_offset=offset, **common)

    outs = _in_lockstep([rank_steps(r) for r in range(tp_size)], group)
    value = all_reduce_sum([o.value for o in outs], precision.dtype)
    if not magnitudes:
        return ExpertExpected(value=value, scale=None)
    return ExpertExpected(value=value, scale=all_reduce_sum([o.scale for o in outs]),
                          underflow=all_reduce_sum([o.underflow for o in outs]) + 1.0,   # + the reduce's rounding
                          **_reduced_variance(outs))


def _reduced_variance(outs) -> dict:
    """The accumulation variance and rounding exposure of a sum over ranks: the ranks' own, plus the reduction's
    fp32 adds of their partials (reference.accumulation) and each partial's own rounding to dt; {} where the ranks
    carry none (FP8)."""
    if any(o.acc_var is None for o in outs):
        return {}
    total = all_reduce_sum([o.value for o in outs])
    squares = all_reduce_sum([o.value * o.value for o in outs])
    return dict(acc_var=all_reduce_sum([o.acc_var for o in outs]) + dot_variance(total, squares, len(outs)),
                round_var=all_reduce_sum([o.round_var + spacing_sq(o.value) for o in outs]))


def _even_split(n: int, parts: int) -> list[int]:
    """Row counts of n rows split into `parts` chunks as evenly as possible (first chunks larger)."""
    base, rem = divmod(n, parts)
    return [base + (1 if r < rem else 0) for r in range(parts)]


def _ep_forward(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, lora, ep_size, tokens_per_rank,
                common) -> ExpertExpected:
    """EP branch of `sharded_experts_forward` (naive all-gather dispatch, reduce-scatter combine)."""
    T = int(hidden.shape[0])
    counts = list(tokens_per_rank) if tokens_per_rank is not None else _even_split(T, ep_size)
    if len(counts) != ep_size or sum(counts) != T or any(c < 0 for c in counts):
        raise ValueError(f"tokens_per_rank must be {ep_size} non-negative counts summing to T={T}, got {counts}")
    E = int(w13.shape[0])
    mapping = None if lora is None else lora.token_lora_mapping
    chunks = lambda t: list(torch.split(t, counts, dim=0))  # noqa: E731
    g_hidden, g_w, g_ids, g_map, _ = ep_dispatch(chunks(hidden), chunks(topk_weights), chunks(topk_ids),
                                                 None if mapping is None else chunks(mapping))
    outs = []
    for rank in range(ep_size):
        emap = ep_expert_map(E, ep_size, rank, device=hidden.device)
        w13_r, w2_r, (b13_r, b2_r) = ep_slice_base(w13, w2, (w13_bias, w2_bias), ep_size, rank)
        lora_r = None
        if lora is not None:
            lora_r = LoRAInputs(stacked=ep_slice_lora(lora.stacked, ep_size, rank), token_lora_mapping=g_map,
                                lora_ids=lora.lora_ids)
        outs.append(moe_experts_forward(g_hidden, w13_r, w2_r, g_w, g_ids, w13_bias=b13_r, w2_bias=b2_r,
                                        lora=lora_r, expert_map=emap, **common))
    value = torch.cat(ep_combine([o.value for o in outs], counts, common["precision"].dtype), dim=0)
    if not common["magnitudes"]:
        return ExpertExpected(value=value, scale=None)
    scale = torch.cat(ep_combine([o.scale for o in outs], counts), dim=0)
    under = torch.cat(ep_combine([o.underflow for o in outs], counts), dim=0) + 1.0   # + the combine's rounding
    return ExpertExpected(value=value, scale=scale, underflow=under, **_reduced_variance(outs))
