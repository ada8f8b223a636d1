"""Metamorphic properties of an expert-level case: a view of its inputs (Case.view) whose output is the plain
case's output mapped through the view. The view's own output is judged against the reference as any case is;
the token views add the comparison with the plain run: bit for bit where the backend declares batch invariance
(Capabilities.batch_invariant, as vLLM's batch-invariant mode promises), else reported, never failed, when the
rows happen to be identical (docs/semantics.md, "Properties"). The "reordered" view sums every long reduction in
another order: the judge's twin run of an fp32 case (harness.judge.expectation.twin_applies).
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
                 "too): the same sums, each reduction over them in another order",
}
# the views under which a batch-invariant backend keeps its bits (a token's inputs and sums are the same); the
# reordered view changes every summation order, so its bits may differ
TOKEN_VIEWS = ("half", "reversed", "slots_rotated")


def contraction_order(n: int) -> torch.Tensor:
    """The reordered view's permutation of a dimension of size n: fixed by n alone (so an output's columns map back
    from its shape), scrambling every position."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(0x5EED + n))


def _gate_up_rows(si: torch.Tensor, n1: int, interleaved: bool) -> torch.Tensor:
    """w13's rows under the order `si` of I: gate and up alike, in the activation's layout ([g; u] split, or
    [g0, u0, g1, u1, ...] interleaved); a non-gated w13's rows are I's."""
    I = si.numel()
    if n1 != 2 * I:
        return si
    return torch.stack([2 * si, 2 * si + 1], dim=1).reshape(-1) if interleaved else torch.cat([si, si + I])


def _reordered(inp, in_place: bool):
    """`inp` with H and I permuted (contraction_order) through every tensor, gate and up by the same order: the
    plain sums in other orders. `in_place`: the base weights are permuted expert by expert where they lie (a served
    layer is not held twice), else copied first."""
    from moe_lora_harness.reference.activations import lookup_activation
    H, I = inp.hidden.shape[1], inp.w2.shape[2]
    pi, si = contraction_order(H).to(inp.hidden.device), contraction_order(I).to(inp.hidden.device)
    rows = _gate_up_rows(si, inp.w13.shape[1], lookup_activation(inp.case.activation, supported_only=False).interleaved)
    w13, w2 = (inp.w13, inp.w2) if in_place else (inp.w13.clone(), inp.w2.clone())
    for e in range(w13.shape[0]):
        w13[e] = w13[e][rows][:, pi]
        w2[e] = w2[e][pi][:, si]
    s = inp.stacked
    if s is not None:
        s = type(s)([a[..., pi].contiguous() for a in s.w13_a], [b[:, :, si, :].contiguous() for b in s.w13_b],
                    [a[..., si].contiguous() for a in s.w2_a], [b[:, :, pi, :].contiguous() for b in s.w2_b],
                    s.adapter_enabled)
    pick = lambda t, idx: None if t is None else t[:, idx].contiguous()  # noqa: E731
    return dataclasses.replace(inp, hidden=inp.hidden[:, pi].contiguous(), w13=w13, w2=w2,
                               w13_bias=pick(inp.w13_bias, rows), w2_bias=pick(inp.w2_bias, pi), stacked=s)


def half_tokens(T: int) -> int:
    """The tokens the "half" view keeps: the first ceil(T/2)."""
    return (T + 1) // 2


def view_inputs(inp, view: str, *, in_place: bool = False):
    """The plain case's inputs `inp` (harness.build.builders.ExpertInputs) seen through `view` (a new object; the
    tensors of `inp` are not changed, unless `in_place`: then the reordered view permutes its base weights where they
    lie, for a caller that holds `inp` nowhere else)."""
    if not view:
        return inp
    if view == "reordered":
        if inp.quantized:
            raise ValueError("view='reordered' permutes the weights' K: quantized weights' blocks would not follow")
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


def plain_rows(out_plain: torch.Tensor, view: str) -> torch.Tensor:
    """The plain run's output rows that the view's output must equal, in the view's order (and its columns')."""
    if view == "half":
        return out_plain[:half_tokens(out_plain.shape[0])]
    if view == "reversed":
        return out_plain.flip(0)
    if view == "reordered":
        return out_plain[:, contraction_order(out_plain.shape[1]).to(out_plain.device)]
    return out_plain


def plain_columns(out_view: torch.Tensor) -> torch.Tensor:
    """The reordered view's output in the plain case's column order (plain_rows' inverse for that view)."""
    out = torch.empty_like(out_view)
    out[:, contraction_order(out_view.shape[1]).to(out_view.device)] = out_view
    return out
