"""Semantic alternatives: named variants of the contract that real MoE-LoRA integrations get wrong.

Beside the rounding models (reference.precision), each entry of ALTERNATIVES says what a wrong integration
computes instead of the contract, so the judge can name the mistake a grossly failing output follows
(harness.judge.semantic_diagnosis). At the expert level an alternative is a rewrite of the LoRA
inputs, a change of one of the forward's `Semantics` switches, or both; at the op level, a rewrite of the op
call's arguments. Adding one is one entry (docs/error-model.md, "Semantic diagnosis").
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from moe_lora_harness.reference.adapters import StackedMoELoRA

__all__ = ["Semantics", "CONTRACT", "Layer", "Alternative", "ALTERNATIVES", "alternative"]


@dataclass(frozen=True)
class Semantics:
    """The choices of the expert forward an integration can get wrong (the contract's values by default).

    w13_lora_weighted: the w13 delta reads the router-weighted input (per pair, x * w) instead of x;
    w2_lora_weight_power: the w2 delta is multiplied by w ** power (1: the contract; 0: unweighted; 2: twice);
    lora_top_k: only the first `lora_top_k` of each token's top-k pairs get LoRA (None: every pair);
    weight_on_output_too: with apply_router_weight_on_input, the w2 output is weighted again.
    """

    w13_lora_weighted: bool = False
    w2_lora_weight_power: int = 1
    lora_top_k: int | None = None
    weight_on_output_too: bool = False


CONTRACT = Semantics()


@dataclass(frozen=True)
class Layer:
    """What an alternative may depend on besides the LoRA inputs: the case's layer facts."""

    top_k: int
    gated: bool
    lora: bool = True
    tp_size: int = 1
    fully_sharded: bool = False
    apply_router_weight_on_input: bool = False
    adapter_scaling: float = 1.0     # the scaling every adapter was packed with (folded into B)


def _b(stacked: StackedMoELoRA, fn: Callable[[Tensor], Tensor], *, w13: bool = True, w2: bool = True):
    """The stacked LoRA with `fn` applied to the chosen B factors (in float64, back in their dtype: every
    rewrite here is exact there)."""
    def each(bs):
        return [fn(b.to(torch.float64)).to(b.dtype) for b in bs]
    return replace(stacked, w13_b=each(stacked.w13_b) if w13 else stacked.w13_b,
                   w2_b=each(stacked.w2_b) if w2 else stacked.w2_b)


def _peft_b_misread(b: Tensor) -> Tensor:
    """B (L, E, out, R) as PEFT stores it, flat (out, R*E) rank-major, read back as if it were (out, E, R)."""
    L, E, out, R = b.shape
    flat = b.permute(0, 2, 3, 1).reshape(L, out, R * E)          # column j*E + e holds B_e[:, j]
    return flat.reshape(L, out, E, R).permute(0, 2, 1, 3)          # read as column e*R + j


def _rank0_w2_only(stacked: StackedMoELoRA, layer: Layer) -> StackedMoELoRA:
    """The unsharded LoRA whose w2 delta is only TP rank 0's share: the I columns of its w2 A (its partial
    delta, summed by the all-reduce), or, fully sharded, the H rows of its w2 B (the slice it writes)."""
    if layer.fully_sharded:
        b = stacked.w2_b[0].clone()
        b[:, :, b.shape[2] // layer.tp_size:, :] = 0
        return replace(stacked, w2_b=[b])
    a = stacked.w2_a[0].clone()
    a[:, :, :, a.shape[3] // layer.tp_size:] = 0
    return replace(stacked, w2_a=[a])


@dataclass(frozen=True)
class Alternative:
    """One wrong integration: `stacked(stacked, layer)` and `mapping(mapping)` rewrite the LoRA inputs (None:
    unchanged; a stacked rewrite returning None drops the LoRA), `semantics` switches the forward; `op(kwargs)`
    rewrites fused_moe_lora's keyword arguments (None: the mistake has no op-level form); `applies(layer)`
    says where the mistake can show at all (elsewhere it is the contract; by default: where there is a LoRA)."""

    name: str
    description: str
    stacked: Callable[[StackedMoELoRA, Layer], StackedMoELoRA | None] | None = None
    mapping: Callable[[Tensor], Tensor] | None = None
    semantics: Semantics = CONTRACT
    op: Callable[[dict], dict] | None = None
    applies: Callable[[Layer], bool] = lambda layer: layer.lora


def _zero(t: Tensor) -> Tensor:
    return torch.zeros_like(t)


def _shift(m: Tensor) -> Tensor:
    return torch.roll(m, 1, dims=0)


def _op(**rewrites):
    """An op-level rewrite: each keyword's function applied to that argument of the call."""
    return lambda kw: dict(kw, **{name: fn(kw[name]) for name, fn in rewrites.items()})


def _each(fn):
    return lambda ts: [fn(t) for t in ts]


ALTERNATIVES = (
    Alternative("no-lora", "no LoRA at all (the base layer's output)", stacked=lambda s, layer: None,
                op=_op(lora_b_stacked=_each(_zero))),
    Alternative("w13-delta-missing", "the w13 LoRA delta missing",
                stacked=lambda s, layer: _b(s, _zero, w2=False)),
    Alternative("w2-delta-missing", "the w2 LoRA delta missing", stacked=lambda s, layer: _b(s, _zero, w13=False)),
    Alternative("w2-delta-unweighted", "the w2 LoRA delta without the router weight",
                semantics=Semantics(w2_lora_weight_power=0), op=_op(topk_weights=torch.ones_like)),
    Alternative("w2-delta-weighted-twice", "the w2 LoRA delta with the router weight applied twice",
                semantics=Semantics(w2_lora_weight_power=2), op=_op(topk_weights=lambda w: w * w)),
    Alternative("gate-up-swapped", "the gate and up slices of the w13 LoRA delta swapped",
                stacked=lambda s, layer: replace(s, w13_a=s.w13_a[::-1], w13_b=s.w13_b[::-1]),
                op=_op(lora_a_stacked=lambda a: a[::-1], lora_b_stacked=lambda b: b[::-1]),
                applies=lambda layer: layer.lora and layer.gated),
    Alternative("scaling-twice", "the adapter scaling applied twice",
                stacked=lambda s, layer: _b(s, lambda b: b * layer.adapter_scaling),
                applies=lambda layer: layer.lora and layer.adapter_scaling != 1.0),
    Alternative("scaling-missing", "the adapter scaling not applied",
                stacked=lambda s, layer: _b(s, lambda b: b / layer.adapter_scaling),
                applies=lambda layer: layer.lora and layer.adapter_scaling != 1.0),
    Alternative("mapping-shifted", "the token -> slot mapping shifted by one token (token t gets token t-1's "
                "slot, token 0 the last token's)", mapping=_shift, op=_op(token_lora_mapping=_shift)),
    Alternative("no-adapter-as-slot-0", "tokens without an adapter (-1) treated as slot 0",
                mapping=lambda m: m.clamp(min=0), op=_op(token_lora_mapping=lambda m: m.clamp(min=0))),
    Alternative("disabled-slot-applied", "a disabled slot's adapter applied",
                stacked=lambda s, layer: replace(s, adapter_enabled=torch.ones_like(s.adapter_enabled)),
                op=_op(adapter_enabled=torch.ones_like)),
    Alternative("lora-first-expert-only", "the LoRA applied only to the first of the top-k experts",
                semantics=Semantics(lora_top_k=1), applies=lambda layer: layer.lora and layer.top_k > 1),
    Alternative("router-weight-on-input-and-output", "the router weight applied on the input and again on "
                "the output", semantics=Semantics(weight_on_output_too=True),
                applies=lambda layer: layer.apply_router_weight_on_input),
    Alternative("w13-lora-weighted-input", "the w13 LoRA reading the router-weighted input",
                semantics=Semantics(w13_lora_weighted=True)),
    Alternative("b-layout-out-e-r", "the B factors read in the (out, E, r) layout instead of PEFT's (out, r, E)",
                stacked=lambda s, layer: _b(s, _peft_b_misread), op=_op(lora_b_stacked=_each(_peft_b_misread))),
    Alternative("tp-w2-delta-one-rank", "under TP, the partial w2 delta added on one rank only",
                stacked=lambda s, layer: _rank0_w2_only(s, layer),
                applies=lambda layer: layer.lora and layer.tp_size > 1),
)

_BY_NAME = {a.name: a for a in ALTERNATIVES}
assert len(_BY_NAME) == len(ALTERNATIVES), "alternative names must be distinct"


def alternative(name: str) -> Alternative:
    """The table's entry `name` (ValueError naming the known ones)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown semantic alternative {name!r}; known: {sorted(_BY_NAME)}") from None
