"""Metamorphic properties of an expert-level case: a view of its inputs (Case.view) whose output is the plain
case's output mapped through the view (an op-level case has the reordered view alone). The view's own output is
judged against the reference as any case is; the token views add the comparison with the plain run: bit for bit
where the backend declares batch invariance (Capabilities.batch_invariant, as vLLM's batch-invariant mode promises),
else reported, never failed, when the rows happen to be identical (docs/semantics.md, "Properties"). The "reordered"
view sums every long reduction in another order: the judge's twin run of an fp32 or FP8 case
(harness.judge.expectation.twin_applies).
"""
from __future__ import annotations

import dataclasses

import torch

# what each view does to the plain case's inputs (harness.spec.case.VIEWS names them)
VIEW_MEANING = {
    "half": "the first ceil(T/2) tokens alone: a token's output must not depend on the rest of its batch",
    "reversed": "the tokens in reverse order: a token's output must not depend on its place in the batch",
    "slots_rotated": "every adapter moved to the next slot and the mapping relabelled: a token's output must not "
                     "depend on the slot number its adapter sits in",
    "reordered": "the hidden and intermediate dimensions permuted through every tensor (the output's hidden columns "
                 "too): the same sums, each reduction over them in another order (an op-level case: K through x "
                 "and every LoRA A, every LoRA B times OP_TWIN_B_SCALE, the output's columns kept)",
}
# the views under which a batch-invariant backend keeps its bits (a token's inputs and sums are the same); the
# reordered view changes every summation order, so its bits may differ
TOKEN_VIEWS = ("half", "reversed", "slots_rotated")


def contraction_order(n: int, blocks: tuple = (), shards: int = 1) -> torch.Tensor:
    """The reordered view's permutation of a dimension of size n: fixed by n (and `blocks`, `shards`) alone (so an
    output's columns map back from its shape), scrambling every position. `blocks` (sizes, largest first, each
    dividing the one before and n): the blocks of each size are permuted whole, and the positions within the smallest:
    quantized weights' scale blocks and activation groups move as units (fp8_block's 128; 64 pairs of an interleaved
    w13). `shards` (a TP case's tp_size): each of that many equal shards keeps its place and is permuted within, so
    that every TP rank holds the same positions and sums them in another order."""
    if shards > 1:
        if n % shards or (blocks and (n // shards) % blocks[0]):
            raise ValueError(f"the reordered view's order of a dimension of {n} splits its {shards} TP shard(s) "
                             f"or their blocks {blocks}")
        inner = contraction_order(n // shards, blocks)
        return (torch.arange(shards)[:, None] * (n // shards) + inner[None, :]).reshape(-1)
    if not blocks:
        return torch.randperm(n, generator=torch.Generator().manual_seed(0x5EED + n))
    b = blocks[0]
    return (contraction_order(n // b)[:, None] * b + contraction_order(b, tuple(blocks[1:]))[None, :]).reshape(-1)


def view_blocks(quant: str, interleaved: bool = False) -> tuple:
    """`contraction_order`'s blocks for a case's H and I under its weight scheme: () where any permutation keeps the
    quantization (none, fp8_w8a8: per output channel and per token), (128,) for fp8_block's H, and for its I (128, 64)
    where w13 interleaves gate and up (a 128-row block of w13 holds 64 of I's positions)."""
    from moe_lora_harness.reference.fp8 import SCHEMES
    block = SCHEMES.get(quant, (None, None))[1]
    if block is None:
        return (), ()
    return (block,), ((block, block // 2) if interleaved else (block,))


def _gate_up_rows(si: torch.Tensor, n1: int, interleaved: bool) -> torch.Tensor:
    """w13's rows under the order `si` of I: gate and up alike, in the activation's layout ([g; u] split, or
    [g0, u0, g1, u1, ...] interleaved); a non-gated w13's rows are I's."""
    I = si.numel()
    if n1 != 2 * I:
        return si
    return torch.stack([2 * si, 2 * si + 1], dim=1).reshape(-1) if interleaved else torch.cat([si, si + I])


def _reordered(inp, in_place: bool):
    """`inp` with H and I permuted (contraction_order) through every tensor, gate and up by the same order: the
    plain sums in other orders. FP8 weights' codes and scales too, blocks whole (`view_blocks`). `in_place`: the base
    weights are permuted expert by expert where they lie (a served layer is not held twice), else copied first."""
    from moe_lora_harness.reference.activations import lookup_activation
    H, I = inp.hidden.shape[1], inp.w2.shape[2]
    interleaved = lookup_activation(inp.case.activation, supported_only=False).interleaved
    h_blocks, i_blocks = view_blocks(inp.case.quant, interleaved)
    dev, tp = inp.hidden.device, inp.case.tp_size    # TP: I and (fully sharded) H permuted within each rank's shard
    pi, si = contraction_order(H, h_blocks, tp).to(dev), contraction_order(I, i_blocks, tp).to(dev)
    rows = _gate_up_rows(si, inp.w13.shape[1], interleaved)
    w13, w2 = (inp.w13, inp.w2) if in_place else (inp.w13.clone(), inp.w2.clone())
    for e in range(w13.shape[0]):
        w13[e] = w13[e][rows][:, pi]
        w2[e] = w2[e][pi][:, si]
    quantized = _reordered_quantized(inp.quantized, rows, pi, si, bool(h_blocks)) if inp.quantized else inp.quantized
    s = inp.stacked
    if s is not None:
        s = type(s)([a[..., pi].contiguous() for a in s.w13_a], [b[:, :, si, :].contiguous() for b in s.w13_b],
                    [a[..., si].contiguous() for a in s.w2_a], [b[:, :, pi, :].contiguous() for b in s.w2_b],
                    s.adapter_enabled)
    pick = lambda t, idx: None if t is None else t[:, idx].contiguous()  # noqa: E731
    return dataclasses.replace(inp, hidden=inp.hidden[:, pi].contiguous(), w13=w13, w2=w2,
                               w13_bias=pick(inp.w13_bias, rows), w2_bias=pick(inp.w2_bias, pi), stacked=s,
                               quantized=quantized)


# the op-level twin's factor on every LoRA B (its own truth and emulation follow): the expand over the rank, which no
# permutation may reorder (a slip tied to a rank index would strike another component in the twin: docs/error-model.md,
# "Why the rank stays in its order"), then rounds at other places in the twin, so that the twins' difference measures
# it too. Not a power of 2 (that would scale every rounding error exactly); above 1, so that the twin's errors are at
# least as large as the plain run's (the twin measure's bound stays conservative); near 1, so that a slip, scaled
# alike in both runs, leaves little of itself in their difference ("The op's expand, measured")
OP_TWIN_B_SCALE = 1.0 + 2.0 ** -6 + 2.0 ** -13


def _reordered_op(inp):
    """An op-level case's inputs with K permuted (contraction_order) through x and every LoRA A, and every LoRA B
    times OP_TWIN_B_SCALE (rounded to its dtype): each shrink sums in another order and each expand rounds elsewhere;
    the output's columns stay where they are. A shared A or B (a stride-0 view over the experts) stays one."""
    pi = contraction_order(inp.x.shape[-1]).to(inp.x.device)

    def shared(t):
        return t.dim() == 4 and t.shape[1] > 1 and t.stride(1) == 0

    def a_view(a):
        if shared(a):
            return a[:, :1][..., pi].contiguous().expand(a.shape)
        return a[..., pi].contiguous()

    def b_view(b):
        if shared(b):
            return (b[:, :1] * OP_TWIN_B_SCALE).to(b.dtype).expand(b.shape)
        return (b * OP_TWIN_B_SCALE).to(b.dtype)
    return dataclasses.replace(inp, x=inp.x[:, pi].contiguous(), lora_a=[a_view(a) for a in inp.lora_a],
                               lora_b=[b_view(b) for b in inp.lora_b])


def _reordered_quantized(quantized: tuple, rows: torch.Tensor, pi: torch.Tensor, si: torch.Tensor,
                         blocked: bool) -> tuple:
    """FP8 (w13 codes, w13 scales, w2 codes, w2 scales) under the view's orders: codes as the weights; scales per
    output channel (E, N) by the rows, or per block (E, N/128, K/128) by each block's source block (the orders move
    blocks whole: `view_blocks`)."""
    from moe_lora_harness.reference.fp8 import BLOCK

    def codes(q, r, c):     # float8 has no CPU indexing kernel: moved as bytes
        raw = q.view(torch.uint8)
        return torch.stack([raw[e][r][:, c] for e in range(raw.shape[0])]).view(q.dtype)

    def source_blocks(order):
        first = order.reshape(-1, BLOCK)
        if not bool((first // BLOCK == first[:, :1] // BLOCK).all()):
            raise ValueError("the reordered view's order splits a quantization block")
        return first[:, 0] // BLOCK

    w13_q, w13_s, w2_q, w2_s = quantized
    if blocked:
        w13_s = w13_s[:, source_blocks(rows)][:, :, source_blocks(pi)].contiguous()
        w2_s = w2_s[:, source_blocks(pi)][:, :, source_blocks(si)].contiguous()
    else:
        w13_s, w2_s = w13_s[:, rows].contiguous(), w2_s[:, pi].contiguous()
    return codes(w13_q, rows, pi), w13_s, codes(w2_q, pi, si), w2_s


def half_tokens(T: int) -> int:
    """The tokens the "half" view keeps: the first ceil(T/2)."""
    return (T + 1) // 2


def view_inputs(inp, view: str, *, in_place: bool = False):
    """The plain case's inputs `inp` (harness.build.builders.ExpertInputs) seen through `view` (a new object; the
    tensors of `inp` are not changed, unless `in_place`: then the reordered view permutes its base weights where they
    lie, for a caller that holds `inp` nowhere else)."""
    if not view:
        return inp
    if inp.case.level == "op":
        if view != "reordered":
            raise ValueError(f"an op-level case has the view 'reordered' alone, got {view!r}")
        return _reordered_op(inp)
    if view == "reordered":
        from moe_lora_harness.harness.spec.case import REORDERED_QUANTS
        if inp.case.quant not in REORDERED_QUANTS:
            raise ValueError(f"view='reordered' permutes the weights' K and N: {inp.case.quant}'s packed weights would "
                             f"not follow (built for {REORDERED_QUANTS})")
        return _reordered(inp, in_place)
    if view == "half":
        n = half_tokens(inp.hidden.shape[0])
        return dataclasses.replace(inp, hidden=inp.hidden[:n].clone(), topk_weights=inp.topk_weights[:n].clone(),
                                   topk_ids=inp.topk_ids[:n].clone(), token_lora_mapping=inp.token_lora_mapping[:n].clone())
    if view == "reversed":
        flip = lambda t: t.flip(0).contiguous()  # noqa: E731
        return dataclasses.replace(inp, hidden=flip(inp.hidden), topk_weights=flip(inp.topk_weights),
                                   topk_ids=flip(inp.topk_ids), token_lora_mapping=flip(inp.token_lora_mapping))
    if view == "slots_rotated":
        s = inp.stacked
        L = s.max_loras
        roll = lambda ts: [t.roll(1, dims=0).contiguous() for t in ts]  # noqa: E731
        enabled = torch.cat([s.adapter_enabled[:L].roll(1, dims=0), s.adapter_enabled[L:]])
        stacked = type(s)(roll(s.w13_a), roll(s.w13_b), roll(s.w2_a), roll(s.w2_b), enabled)
        m = inp.token_lora_mapping
        mapping = torch.where(m >= 0, (m + 1) % L, m).to(m.dtype)
        return dataclasses.replace(inp, stacked=stacked, token_lora_mapping=mapping)
    raise ValueError(f"view must be one of {tuple(VIEW_MEANING)} or '', got {view!r}")


def plain_rows(out_plain: torch.Tensor, view: str, quant: str = "none", level: str = "expert",
               shards: int = 1) -> torch.Tensor:
    """The plain run's output rows that the view's output must equal, in the view's order (and its columns'; an
    op-level case's reordered view keeps them; `shards`: a TP case's tp_size)."""
    if level == "op":
        return out_plain
    if view == "half":
        return out_plain[:half_tokens(out_plain.shape[0])]
    if view == "reversed":
        return out_plain.flip(0)
    if view == "reordered":
        return out_plain[:, _column_order(out_plain, quant, shards)]
    return out_plain


def plain_columns(out_view: torch.Tensor, quant: str = "none", level: str = "expert", shards: int = 1) -> torch.Tensor:
    """The reordered view's output in the plain case's column order (plain_rows' inverse for that view; `quant`: the
    case's weight scheme, whose blocks the order keeps; an op-level case's view moves no column; `shards`: a TP
    case's tp_size, whose shards the order keeps)."""
    if level == "op":
        return out_view
    out = torch.empty_like(out_view)
    out[:, _column_order(out_view, quant, shards)] = out_view
    return out


def _column_order(out: torch.Tensor, quant: str, shards: int) -> torch.Tensor:
    """The reordered view's order of an expert-level output's hidden columns (the order of H), on `out`'s device."""
    return contraction_order(out.shape[1], view_blocks(quant)[0], shards).to(out.device)


def twin_columns(out_view: torch.Tensor, case) -> torch.Tensor:
    """`case`'s reordered view's output (a twin run's) in the plain case's columns."""
    return plain_columns(out_view, case.quant, case.level, case.tp_size)
