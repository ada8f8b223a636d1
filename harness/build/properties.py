"""Metamorphic properties of an expert-level case: a view of its inputs (Case.view) whose output is the plain
case's output mapped through the view. The view's own output is judged against the reference as any case is;
the property adds the comparison with the plain run: bit for bit where the backend declares batch invariance
(Capabilities.batch_invariant, as vLLM's batch-invariant mode promises), else reported, never failed, when the
rows happen to be identical (docs/semantics.md, "Properties").
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
}


def half_tokens(T: int) -> int:
    """The tokens the "half" view keeps: the first ceil(T/2)."""
    return (T + 1) // 2


def view_inputs(inp, view: str):
    """The plain case's inputs `inp` (harness.build.builders.ExpertInputs) seen through `view` (a new object; the
    tensors of `inp` are not changed)."""
    if not view:
        return inp
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
    """The plain run's output rows that the view's output must equal, in the view's order."""
    if view == "half":
        return out_plain[:half_tokens(out_plain.shape[0])]
    if view == "reversed":
        return out_plain.flip(0)
    return out_plain
