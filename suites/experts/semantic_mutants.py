"""Planted integration mistakes: the eager experts (kernels.eager_experts) wired into a layer wrongly, one way
each, as a real integration gets it wrong; the selftest's "semantics" corpus.

Each mistake is made where an integration makes it (the arguments it hands the experts, or the LoRA op calls
it issues), written here independently of reference.semantics, whose table must name each of them
(MECHANISMS: backend name -> the alternative it commits). `semantics-control` wires everything right.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref

import torch

from moe_lora_harness.backends.eager import run_experts
from moe_lora_harness.harness.build.builders import ADAPTER_SCALING
from moe_lora_harness.harness.spec.contract import BackendSpec, Capabilities
from moe_lora_harness.kernels import eager_experts


_REWRITE = threading.local()      # .fn: this thread's LoRA-call rewrite while a mutant runs (None: none)
_OP = eager_experts.fused_moe_lora


def _routed(y, x, a, b, **kw):
    """The eager experts' LoRA op, through the calling thread's rewrite when one is set: a module attribute
    swapped per call would leak into other threads' (and later) calls when calls overlap."""
    rewrite = getattr(_REWRITE, "fn", None)
    if rewrite is not None:
        y, x, kw = rewrite(y, x, dict(kw))
    _OP(y, x, a, b, **kw)


@contextlib.contextmanager
def _lora_calls(rewrite):
    """Route this thread's eager LoRA op calls through `rewrite(kwargs) -> kwargs` (w13: mul_routed_weight
    False; w2: True) for the duration of one call."""
    eager_experts.fused_moe_lora = _routed     # idempotent; a pass-through for every other caller
    outer = getattr(_REWRITE, "fn", None)
    _REWRITE.fn = rewrite
    try:
        yield
    finally:
        _REWRITE.fn = outer


def run_eager(call, rewrite=None):
    """The eager backend on `call` (the ExpertCall as the integration hands it over)."""
    with _lora_calls(rewrite) if rewrite is not None else contextlib.nullcontext():
        run_experts(call)


def _w2_only(fn):
    """A LoRA-call rewrite applied to the w2 delta's call only (the one that multiplies by the weight)."""
    return lambda y, x, kw: fn(y, x, kw) if kw["mul_routed_weight"] else (y, x, kw)


def _weights(scale):
    def rewrite(y, x, kw):
        w = kw["topk_weights"].float()
        kw["topk_weights"] = scale(w)
        return y, x, kw
    return rewrite


def _first_expert_only(y, x, kw):
    """Every pair but each token's first loses its expert id in the LoRA calls (naive layout: one id per pair)."""
    k = kw["top_k_num"]
    ids = kw["expert_ids"].clone()
    pair = torch.arange(ids.numel(), device=ids.device)
    ids[pair % k != 0] = -1
    kw["expert_ids"] = ids
    return y, x, kw


def _w13_reads_weighted_input(y, x, kw):
    """The w13 delta fed the per-pair, router-weighted input (rows by pair, times the pair's weight)."""
    if kw["mul_routed_weight"]:
        return y, x, kw
    k = kw["top_k_num"]
    kw["mul_routed_weight"] = True
    return y, x.repeat_interleave(k, dim=0), kw


def _peft_layout_misread(b: torch.Tensor) -> torch.Tensor:
    """A backend that repacks B through PEFT's flat (out, r*E) layout, column j*E + e = B_e[:, j], and reads
    column c back as expert c // r, rank c % r."""
    E, R = b.shape[1], b.shape[3]
    fixed = torch.empty_like(b)
    for e in range(E):
        for j in range(R):
            c = e * R + j                       # where it reads (out, E, r)
            fixed[:, e, :, j] = b[:, c % E, :, c // E]   # what PEFT's layout holds there
    return fixed


def _with(call, **changes):
    return dataclasses.replace(call, **changes)


def _lora(rewrite):
    """A mistake in how the LoRA is handed over: a call without LoRA runs as it is."""
    return lambda call: run_eager(call if call.w13_lora_a is None else rewrite(call))


def _scaled_b(call, factor):
    return _with(call, w13_lora_b=[b * factor for b in call.w13_lora_b], w2_lora_b=[b * factor for b in call.w2_lora_b])


def _router_weight_on_input_and_output(call):
    """Weights the input itself (as the prepare step does) but then runs the experts as if it had not: the w2
    output is weighted again. The w13 LoRA still reads the unweighted states, as it must."""
    if not call.apply_router_weight_on_input:
        return run_eager(call)
    dt = call.hidden_states.dtype
    weighted = (call.hidden_states.float() * call.topk_weights.to(dt).float()).to(dt)
    original = call.hidden_states

    def lora_reads_original(y, x, kw):
        return (y, original, kw) if not kw["mul_routed_weight"] else (y, x, kw)
    run_eager(_with(call, hidden_states=weighted, apply_router_weight_on_input=False),
         lora_reads_original if call.w13_lora_a is not None else None)


_KEPT_MAPPINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # layer (its w13) -> batch size -> mapping


def _mapping_kept_across_calls(call):
    """The layer keeps the token -> slot mapping it prepared for the first batch of each size and hands it to every
    later call of that size (a metadata cache keyed by the batch size, never refreshed)."""
    kept = _KEPT_MAPPINGS.setdefault(call.w13, {})
    mapping = kept.setdefault(int(call.hidden_states.shape[0]), call.token_lora_mapping.clone())
    return _with(call, token_lora_mapping=mapping)


# backend name -> (what it does, the run, the semantic alternative (reference.semantics) it commits)
_PLANTED = {
    "semantics-control": ("No mistake: the eager experts wired right.", run_eager, None),
    "drops-lora": ("Never hands the LoRA to the experts.",
                   _lora(lambda c: _with(c, w13_lora_a=None, w13_lora_b=None, w2_lora_a=None, w2_lora_b=None)),
                   "no-lora"),
    "drops-w13-delta": ("Hands zeroed w13 B buffers (the w13 adapter never loaded).",
                        _lora(lambda c: _with(c, w13_lora_b=[torch.zeros_like(b) for b in c.w13_lora_b])),
                        "w13-delta-missing"),
    "drops-w2-delta": ("Hands zeroed w2 B buffers (the w2 adapter never loaded).",
                       _lora(lambda c: _with(c, w2_lora_b=[torch.zeros_like(b) for b in c.w2_lora_b])),
                       "w2-delta-missing"),
    "w2-delta-unweighted": ("Calls the w2 LoRA op with unit weights.",
                            lambda c: run_eager(c, _w2_only(_weights(torch.ones_like))), "w2-delta-unweighted"),
    "w2-delta-weighted-twice": ("Calls the w2 LoRA op with the weights squared (weighted before and in the op).",
                                lambda c: run_eager(c, _w2_only(_weights(lambda w: w * w))), "w2-delta-weighted-twice"),
    "gate-up-swapped": ("Hands the w13 LoRA slices as [up, gate].",
                        _lora(lambda c: _with(c, w13_lora_a=c.w13_lora_a[::-1], w13_lora_b=c.w13_lora_b[::-1])),
                        "gate-up-swapped"),
    "scales-twice": ("Multiplies B by the adapter's scaling although loading already did.",
                     _lora(lambda c: _scaled_b(c, ADAPTER_SCALING)), "scaling-twice"),
    "unscaled": ("Divides the scaling back out of B (it loads unscaled factors).",
                 _lora(lambda c: _scaled_b(c, 1.0 / ADAPTER_SCALING)), "scaling-missing"),
    "mapping-off-by-one": ("Rolls the token -> slot mapping by one token.",
                           _lora(lambda c: _with(c, token_lora_mapping=torch.roll(c.token_lora_mapping, 1))),
                           "mapping-shifted"),
    "no-adapter-as-slot-0": ("Clamps the mapping at 0, so tokens without an adapter use slot 0.",
                             _lora(lambda c: _with(c, token_lora_mapping=c.token_lora_mapping.clamp(min=0))),
                             "no-adapter-as-slot-0"),
    "ignores-adapter-enabled": ("Marks every slot enabled.",
                                _lora(lambda c: _with(c, adapter_enabled=torch.ones_like(c.adapter_enabled))),
                                "disabled-slot-applied"),
    "lora-first-expert-only": ("Gives the LoRA op only each token's first expert.",
                               lambda c: run_eager(c, _first_expert_only), "lora-first-expert-only"),
    "router-weight-twice": ("Weights the input for apply_router_weight_on_input and the output too.",
                            _router_weight_on_input_and_output, "router-weight-on-input-and-output"),
    "w13-lora-weighted-input": ("Feeds the w13 LoRA the router-weighted input.",
                                lambda c: run_eager(c, _w13_reads_weighted_input), "w13-lora-weighted-input"),
    "mapping-kept-across-calls": ("Keeps the first call's token -> slot mapping for later calls of its batch size "
                                  "(one layer's decode steps).",
                                  _lora(_mapping_kept_across_calls), None),
    "peft-b-layout": ("Repacks B through PEFT's (out, r*E) layout and reads it as (out, E*r).",
                      _lora(lambda c: _with(c, w13_lora_b=[_peft_layout_misread(b) for b in c.w13_lora_b],
                                            w2_lora_b=[_peft_layout_misread(b) for b in c.w2_lora_b])),
                      "b-layout-out-e-r"),
}


def _spec(name: str, doc: str, fn) -> BackendSpec:
    return BackendSpec(name=name, description=doc,
                       capabilities=Capabilities(levels=frozenset({"expert"}), tensor_parallel=True,
                                                 activations=frozenset(eager_experts.SUPPORTED)),
                       experts=fn, precision="one_shot")


BACKENDS = [_spec(name, doc, fn) for name, (doc, fn, _) in _PLANTED.items()]
MECHANISMS = {name: alt for name, (_, _, alt) in _PLANTED.items() if alt is not None}
