"""Semantic diagnosis: which integration mistake (reference.semantics) a failing output follows, and which
tokens, slots and experts a partial failure's rows are.

An output that fails beyond every rounding model is judged again, under the same error model, against each
semantic alternative that applies to the case and differs from the contract there; the ones it passes are
named. docs/error-model.md ("Semantic diagnosis") gives the rules.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from moe_lora_harness.harness.build.builders import ADAPTER_SCALING, torch_dtype
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.judge.compare import compare_written, rule2_bound, same_bits
from moe_lora_harness.harness.judge.expectation import Rules, judging
from moe_lora_harness.harness.build.expert_runner import expert_forward, mma_kwargs
from moe_lora_harness.op_contract.validate import validate_call
from moe_lora_harness.reference.activations import is_gated
from moe_lora_harness.reference.lora_op import fused_moe_lora_expected
from moe_lora_harness.reference.precision import bound_dtype
from moe_lora_harness.reference.precision import precision as make_precision
from moe_lora_harness.reference.semantics import ALTERNATIVES, Alternative, Layer

JUDGED = 3    # alternatives judged in full: the ones whose values are nearest the output


@dataclass
class SemanticFit:
    """One alternative against the output: its aggregate ratio and whether the output passes against it."""

    name: str
    description: str
    ratio: float
    passes: bool
    kind: str = "pass"     # compare_written's verdict kind against it (untouched: it leaves changed elements alone)


@dataclass
class SemanticDiagnosis:
    """The alternatives the output follows (best first; empty: none fits), and the nearest ones judged."""

    matched: list
    fits: list = field(default_factory=list)     # the alternatives judged in full, best first
    offered: list = field(default_factory=list)  # names of every alternative that applies and differs here
    contract_ratio: float | None = None   # the output's aggregate ratio against the contract (None: untouched)
    text: str = ""

    @property
    def name(self) -> str:
        """The best-fitting alternative's name ('' when none fits)."""
        return self.matched[0].name if self.matched else ""


def layer_of(case: Case) -> Layer:
    """The layer facts the alternatives read, from a case (op level: the one call's)."""
    if case.level == "op":
        return Layer(top_k=case.top_k, gated=case.num_slices == 2)
    return Layer(top_k=case.top_k, gated=is_gated(case.activation), lora=case.lora, tp_size=case.tp_size,
                 fully_sharded=case.fully_sharded and case.lora,
                 apply_router_weight_on_input=case.apply_router_weight_on_input, adapter_scaling=ADAPTER_SCALING)


def _alternative_kwargs(alt: Alternative, kw: dict, layer: Layer) -> dict | None:
    """The expert forward's keywords with `alt`'s rewrites (None: the alternative needs a LoRA the case lacks)."""
    kw = dict(kw, semantics=alt.semantics)
    lora = kw.get("lora")
    if alt.stacked is None and alt.mapping is None:
        return kw
    if lora is None:
        return None
    stacked = lora.stacked if alt.stacked is None else alt.stacked(lora.stacked, layer)
    if stacked is None:
        kw["lora"] = None
        if kw.get("fully_sharded"):
            kw["fully_sharded"] = False
        return kw
    mapping = lora.token_lora_mapping if alt.mapping is None else alt.mapping(lora.token_lora_mapping)
    kw["lora"] = dataclasses.replace(lora, stacked=stacked, token_lora_mapping=mapping)
    return kw


def _computers(case: Case, inputs, layer: Layer, mma=None):
    """(alternative, compute(precision, magnitudes) -> its expected output) for each alternative with a form
    at the case's level that applies to it; an emulation's FP8 GEMMs on the e4m3 MMA `mma` (Rules.mma)."""
    if case.level == "op":
        kw = inputs.call_kwargs()
        for alt in ALTERNATIVES:
            if alt.op is not None and alt.applies(layer):
                yield alt, (lambda prec, magnitudes, k=alt.op(kw): fused_moe_lora_expected(
                    validate_call(**k), precision=prec, magnitudes=magnitudes))
        return
    forward, args, kw = expert_forward(case, inputs)
    on_mma = mma_kwargs(inputs, mma)
    for alt in ALTERNATIVES:
        alt_kw = _alternative_kwargs(alt, kw, layer) if alt.applies(layer) else None
        if alt_kw is not None:
            yield alt, (lambda prec, magnitudes, k=alt_kw: forward(
                *args, precision=prec, magnitudes=magnitudes, **k, **({} if magnitudes or prec.exact else on_mma)))


def semantic_diagnosis(case: Case, backend_precision: str, output: torch.Tensor, inputs, truth, emulation,
                       contract_ratio: float | None, before: torch.Tensor | None = None,
                       rules: Rules = Rules()) -> SemanticDiagnosis | None:
    """Judge `output` against every semantic alternative that applies to the case and differs from the
    contract there (its truth would fail against the contract). Op level: elements an alternative does not
    write must hold `before` (the buffer as handed over) bit for bit, as the contract's must. `rules`: the verdict's
    (expectation.Rules), so that an alternative is judged as the contract was."""
    if truth is None:
        return None
    dtype = torch_dtype(case)
    written, k_plus_r, _ = judging(case, truth)
    out = output.detach().to(truth.value.device)
    o64 = out.to(torch.float64)
    exact, declared = make_precision("exact", None), make_precision(backend_precision, dtype)
    judge = dict(dtype=bound_dtype(backend_precision, dtype), k_plus_r=k_plus_r, work_dtype=dtype)
    offered = []      # (distance of the output from the alternative's value, alternative, compute, its written)
    for alt, compute in _computers(case, inputs, layer_of(case), rules.mma):
        got = compute(exact, False)
        alt_written = got.written if case.level == "op" else written
        if torch.equal(alt_written, written) and compare_written(
                got.value, truth.value, emulation, truth.scale, written, underflow=truth.underflow,
                **rules.kwargs(truth), **judge).ok:
            continue     # the contract's judge cannot tell it from the contract on this case: not offered
        expected = torch.where(alt_written, got.value, o64 if before is None else before.to(torch.float64))
        diff = torch.where(o64.isnan() & expected.isnan(), torch.zeros_like(o64), o64 - expected)
        diff = torch.nan_to_num(diff, nan=float("inf"))[alt_written | written]
        offered.append((float(torch.linalg.vector_norm(diff)), alt, compute, alt_written))
    offered.sort(key=lambda o: o[0])
    fits = []
    for _, alt, compute, alt_written in offered[:JUDGED]:  # the nearest, judged in full (magnitudes, emulation)
        alt_truth, alt_emu = compute(exact, True), compute(declared, False).value
        v = compare_written(out, alt_truth.value, alt_emu, alt_truth.scale, alt_written,
                            underflow=alt_truth.underflow, **rules.kwargs(alt_truth), before=before, **judge)
        fits.append(SemanticFit(alt.name, alt.description, v.ratio, v.ok, v.kind))
    fits.sort(key=lambda f: (not f.passes, f.ratio))
    matched = [f for f in fits if f.passes]
    against = (f"{contract_ratio:.3g} against the contract" if contract_ratio is not None
               else "where the contract leaves elements untouched, the output changed them")
    if matched:
        best = matched[0]
        text = (f"consistent with {best.description} ({best.name}): aggregate ratio {best.ratio:.3g} against that "
                f"model, {against}")
        if len(matched) > 1:
            text += "; also consistent with " + ", ".join(f"{f.name} ({f.ratio:.3g})" for f in matched[1:])
    elif fits:
        near = fits[0]
        text = (f"no semantic alternative fits ({len(offered)} tried); nearest: {near.description} ({near.name}), "
                + (f"aggregate ratio {near.ratio:.3g} against it" if near.kind != "untouched"
                   else "which leaves elements untouched that the output changed")
                + f", {against}")
    else:
        text = "no semantic alternative applies to this case (each equals the contract here)"
    return SemanticDiagnosis(matched, fits, [o[1].name for o in offered], contract_ratio, text)


def failing_rows(case: Case, backend_precision: str, output: torch.Tensor, truth, emulation: torch.Tensor,
                 before: torch.Tensor | None = None, rules: Rules = Rules()) -> torch.Tensor:
    """(rows,) bool: the output rows (expert level: tokens; op level: (token, top-k) pairs, flattened) with an
    element over its per-element bound (rule 2 as the verdict applies it: compare.rule2_bound under `rules`),
    non-finite where the truth is finite, or (given `before`, the buffer as handed over) an element the contract does
    not write that differs from it."""
    dtype = torch_dtype(case)
    written, k_plus_r, _ = judging(case, truth)
    o = output.detach().to(truth.value.device, torch.float64)
    bound = rule2_bound(o, truth.value, emulation.to(o.device), truth.scale, written,
                        dtype=bound_dtype(backend_precision, dtype), k_plus_r=k_plus_r, underflow=truth.underflow,
                        work_dtype=dtype, **rules.kwargs(truth))
    bad = ((o - truth.value).abs() > bound) | (~torch.isfinite(o) & torch.isfinite(truth.value))
    bad = bad & written
    if before is not None:
        o = output.detach().to(truth.value.device)
        bad = bad | (~written & ~same_bits(o, before.to(o.device, o.dtype)))
    return bad.reshape(-1, bad.shape[-1]).any(dim=1)



def _row_facts(case: Case, inputs) -> list[dict]:
    """Per output row: the adapter slot, the experts and (dispatched EP) the source rank."""
    ids, mapping = inputs.topk_ids, inputs.token_lora_mapping
    if case.level == "op":
        k = ids.shape[1]
        return [{"slot": int(mapping[p // k]), "experts": frozenset({int(ids[p // k, p % k])})}
                for p in range(ids.numel())]
    rows = []
    for t in range(ids.shape[0]):
        facts = {"slot": int(mapping[t]), "experts": frozenset(int(e) for e in ids[t].tolist())}
        if case.dispatched:
            facts["ep rank"] = case.rank_of_token(t)
        rows.append(facts)
    return rows


def locate(case: Case, inputs, bad: torch.Tensor) -> str:
    """Which rows fail, and what every failing row has that no passing row has (an adapter slot, an expert, a
    source EP rank); '' when every row fails or none does."""
    n_bad, n = int(bad.sum()), int(bad.numel())
    if n_bad in (0, n):
        return ""
    unit = "tokens" if case.level == "expert" else "(token, top-k) pairs"
    facts = _row_facts(case, inputs)
    failing = [f for f, b in zip(facts, bad.tolist()) if b]
    passing = [f for f, b in zip(facts, bad.tolist()) if not b]
    shared = []
    slots = {f["slot"] for f in failing}
    if len(slots) == 1 and all(f["slot"] not in slots for f in passing):
        s = slots.pop()
        shared.append("no adapter" if s < 0 else f"adapter slot {s}")
    only = [e for e in sorted(frozenset.intersection(*[f["experts"] for f in failing]))
            if all(e not in f["experts"] for f in passing)]
    if only:
        shared.append("expert " + ", ".join(map(str, only)))
    ranks = {f.get("ep rank") for f in failing}
    if len(ranks) == 1 and None not in ranks and all(f.get("ep rank") not in ranks for f in passing):
        shared.append(f"EP rank {ranks.pop()}")
    rows = bad.nonzero().flatten().tolist()
    listed = ", ".join(map(str, rows[:12])) + (", ..." if len(rows) > 12 else "")
    head = f"{n_bad} of {n} {unit} fail ({listed})"
    if not shared:
        return head + "; no adapter slot, expert or rank sets them apart from the passing ones"
    return head + "; every failing row, and no passing one, has " + " and ".join(shared)
