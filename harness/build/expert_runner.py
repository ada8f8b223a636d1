"""Expert-level runs: the float64 expectations of a case, and the simulated tensor-parallel ranks a backend runs as
(dispatched expert-parallel ranks: harness.execution.ep_ranks)."""
from __future__ import annotations

import dataclasses

import torch

from moe_lora_harness.harness.build.builders import build_expert_inputs, torch_dtype
from moe_lora_harness.harness.build.guards import guard_calls
from moe_lora_harness.harness.spec.case import FP8_QUANTS, Case
from moe_lora_harness.harness.spec.contract import BackendSpec
from moe_lora_harness.reference.experts import ExpertExpected, LoRAInputs, moe_experts_forward
from moe_lora_harness.reference.fp8_mma import KernelMMA
from moe_lora_harness.reference.precision import precision as make_precision
from moe_lora_harness.reference.sharding import all_reduce_sum, sharded_experts_forward, tp_slice_base, tp_slice_lora


# a CUDA judge runs the forward over chunks of tokens whose float64 intermediates hold at most this many values
# per (pair, width) array: a DeepSeek-V3 layer at 16384 tokens needs about 190 GB in one piece, about 45 in chunks
# of 2^28; 2^27 since the statistical model's two more magnitudes (issue 30: with 2^28 the DeepSeek-V3 production
# case ran the H200 out of memory beside the GPU lane's other workers)
PAIR_VALUES_PER_CHUNK = 1 << 27


def token_chunk(case: Case) -> int:
    """Tokens per piece of a CUDA judge's forward: top_k pairs per token, each with float64 values at the widths
    N1 (w13 out), I (activation) and H (w2 out); a function of the case alone, so a REPRO computes the same."""
    return max(1, PAIR_VALUES_PER_CHUNK // (case.top_k * (case.N1 + case.I + case.H)))


def _in_token_chunks(forward, chunk: int):
    """`forward` run on consecutive slices of `chunk` tokens (every step of it is per token), the pieces of its
    result concatenated: the same values up to the order of float64 sums inside the GEMMs."""
    def chunked(hidden, w13, w2, topk_weights, topk_ids, *, lora=None, **kw):
        pieces = []
        for lo in range(0, hidden.shape[0], chunk):
            s = slice(lo, lo + chunk)
            part_lora = (None if lora is None
                         else dataclasses.replace(lora, token_lora_mapping=lora.token_lora_mapping[s]))
            pieces.append(forward(hidden[s], w13, w2, topk_weights[s], topk_ids[s], lora=part_lora, **kw))
        return ExpertExpected(**{f.name: None if getattr(pieces[0], f.name) is None
                                 else torch.cat([getattr(p, f.name) for p in pieces])
                                 for f in dataclasses.fields(ExpertExpected)})
    return chunked


def expert_forward(case: Case, inp):
    """(forward, positional args, keywords) of the reference forward for an expert-level case's inputs: the
    layer's, or (tp_size > 1, dispatched EP) the sharded forward over every simulated rank, recombined with
    the collectives. `precision` (and `magnitudes`, `semantics`) are the caller's. On a CUDA device a case of more
    than `token_chunk(case)` tokens is computed in pieces of that many (not dispatched EP, whose token split is
    the ranks'); on the CPU in one piece, as always."""
    lora = LoRAInputs(inp.stacked, inp.token_lora_mapping) if inp.stacked is not None else None
    kw = dict(activation=case.activation, w13_bias=inp.w13_bias, w2_bias=inp.w2_bias, lora=lora,
              apply_router_weight_on_input=case.apply_router_weight_on_input)
    if case.quant in FP8_QUANTS:   # the base GEMMs read the quantized activations (docs/semantics.md 9.1)
        kw.update(act_quant=case.quant)
    if case.dispatched:   # the whole concatenated batch, dispatched and combined as the ranks must
        forward = sharded_experts_forward
        kw.update(ep_size=case.ep_size, tokens_per_rank=list(case.ep_tokens))
    elif case.tp_size > 1:
        forward = sharded_experts_forward
        kw.update(tp_size=case.tp_size, fully_sharded=case.fully_sharded and case.lora)
    else:
        forward = moe_experts_forward
        kw.update(expert_map=inp.expert_map)
    chunk = token_chunk(case)
    if inp.hidden.device.type == "cuda" and not case.dispatched and case.T > chunk:
        forward = _in_token_chunks(forward, chunk)
    return forward, (inp.hidden, inp.w13, inp.w2, inp.topk_weights, inp.topk_ids), kw


def mma_kwargs(inp, mma: int | str | None) -> dict:
    """The forward's keywords that run an emulation's FP8 base GEMMs on the e4m3 MMA `mma` (a promotion tile or
    "chained": harness.judge.expectation.modelled_mma) over the inputs' weight codes; {} for None and "fp32" (exact
    products summed: the forward's own GEMMs)."""
    if mma is None or mma == "fp32":
        return {}
    q13, s13, q2, s2 = inp.quantized
    return dict(fp8_mma=KernelMMA(None if mma == "chained" else mma, (q13, s13), (q2, s2)))


def expert_expectations(case: Case, backend_precision: str, emulation_only: bool = False, device="cpu", inputs=None,
                        mma: int | str | None = None):
    """(inputs, truth, emulation) for an expert-level case, built (unless `inputs` are given) and computed on
    `build_device(device)` (a CUDA device, else the CPU); `emulation_only`: truth None. `mma` (an FP8 case:
    harness.judge.expectation.modelled_mma): the emulation's base GEMMs run that e4m3 MMA promotion."""
    inp = inputs if inputs is not None else build_expert_inputs(case, device)
    forward, args, kw = expert_forward(case, inp)
    truth = None if emulation_only else forward(*args, precision=make_precision("exact", None), **kw)
    kw = dict(kw, **mma_kwargs(inp, mma))
    # the emulation's value only: it is judged with the truth's magnitudes
    emu = forward(*args, precision=make_precision(backend_precision, torch_dtype(case)), magnitudes=False, **kw)
    return inp, truth, emu


def run_calls(spec: BackendSpec, call, case: Case) -> torch.Tensor:
    """`call` handed to the backend whole, or (case.call_tokens) in consecutive calls of that many tokens, as a
    layer is called at each decode step: the same weights, each call its own tokens, mapping and rows of the
    NaN-poisoned output (a view of it: each call writes its rows in place). Returns `call.output`, as one call
    does."""
    if not case.call_tokens:
        spec.experts(call)
        return call.output
    for lo in range(0, case.T, case.call_tokens):
        s = slice(lo, lo + case.call_tokens)
        spec.experts(dataclasses.replace(
            call, output=call.output[s], hidden_states=call.hidden_states[s], topk_weights=call.topk_weights[s],
            topk_ids=call.topk_ids[s],
            token_lora_mapping=None if call.token_lora_mapping is None else call.token_lora_mapping[s]))
    return call.output


class SimulatedTPGroup:
    """The fully-sharded LoRA joins of `size` TP ranks that run one after another, by replay.

    A rank cannot wait for the others inside its forward, so the forward runs in passes over all ranks:
    pass 1 records every rank's w13 shrink output (the join returns a stand-in of the right shape), pass 2
    joins w13 from those records and records the w2 shrink outputs (which depend on the w13 join), pass 3
    joins both; only pass 3's outputs count. Needs a backend that computes the same caches when run again
    on the same inputs (a nondeterministic one differs only in rounding). Joins as NCCL would: w13
    all-gather on the last (rank) dim in rank order; w2 all-reduce, summed in fp32 (float64 caches in
    float64) and rounded once.
    """

    PASSES = 3

    def __init__(self, size: int):
        self.size = size
        self.records: dict = {}   # (which, call index, rank) -> cache of the latest pass

    def hook(self, rank: int, pass_no: int):
        """The `lora_collective(cache, which)` for one rank's forward in pass `pass_no` (1-based)."""
        calls: dict = {}

        def collective(cache: torch.Tensor, which: str) -> torch.Tensor:
            if which not in ("w13", "w2"):
                raise ValueError(f"lora_collective: which must be 'w13' or 'w2'; got {which!r}")
            idx = calls[which] = calls.get(which, -1) + 1
            self.records[(which, idx, rank)] = cache.detach().clone()
            ready = pass_no >= (2 if which == "w13" else 3)
            if not ready:
                return torch.cat([cache] * self.size, dim=-1) if which == "w13" else cache
            parts = [cache if r == rank else self.records.get((which, idx, r)) for r in range(self.size)]
            if any(p is None for p in parts):
                raise RuntimeError(f"simulated TP: rank(s) {[r for r, p in enumerate(parts) if p is None]} never "
                                   f"joined {which} call {idx} (a fully-sharded rank skipped its collective)")
            if which == "w13":
                return torch.cat(parts, dim=-1)
            acc = torch.promote_types(cache.dtype, torch.float32)   # fp32 for 16-bit caches, float64 stays
            return torch.stack([p.to(acc) for p in parts]).sum(0).to(cache.dtype)
        return collective


def _rank_call(inp, case: Case, rank: int, device):
    """The ExpertCall of TP rank `rank`: base weights and LoRA sliced as vLLM shards them (no collective yet)."""
    from moe_lora_harness.reference.activations import lookup_activation
    act = lookup_activation(case.activation)
    w13, w2, b13, b2 = tp_slice_base(inp.w13, inp.w2, case.tp_size, rank, act.gated, inp.w13_bias, inp.w2_bias,
                                     interleaved=act.interleaved)
    fs = case.fully_sharded and case.lora
    stacked = tp_slice_lora(inp.stacked, case.tp_size, rank, fs) if inp.stacked is not None else None
    call = dataclasses.replace(inp, w13=w13, w2=w2, w13_bias=b13, w2_bias=b2, stacked=stacked).call(device)
    return dataclasses.replace(call, tp_rank=rank, tp_size=case.tp_size, fully_sharded=fs)


def run_tp_ranks(spec: BackendSpec, inp, case: Case, device, watch=None, bands: list | None = None) -> torch.Tensor:
    """Every simulated TP rank's forward, their (T, H) outputs all-reduced (float64 sum, one rounding):
    what the layer returns after vLLM's final reduction. Each pass writes fresh NaN-poisoned outputs.
    `watch` (an execute.InputWatch) snapshots each rank's inputs before the first pass. With `bands` (a list), each
    rank's tensors, and each pass's fresh output, are handed over between guard bands, kept there to be read."""
    fs = case.fully_sharded and case.lora
    group = SimulatedTPGroup(case.tp_size)
    calls = [_rank_call(inp, case, r, device) for r in range(case.tp_size)]
    guarded = [None] * len(calls)
    if bands is not None:
        calls, guarded = guard_calls(calls, [f"rank{r}." for r in range(case.tp_size)])
        bands.extend(guarded)
    if watch is not None:
        for r, call in enumerate(calls):
            watch.add(f"rank{r}", call)
    outs = []
    for pass_no in range(1, (SimulatedTPGroup.PASSES if fs else 1) + 1):
        outs = []
        for r, call in enumerate(calls):
            fresh = torch.full_like(call.output, float("nan"))
            if guarded[r] is not None:
                fresh = guarded[r].wrap(f"rank{r}.output" + (f" (pass {pass_no})" if fs else ""), fresh)
            call = dataclasses.replace(call, output=fresh, lora_collective=group.hook(r, pass_no) if fs else None)
            spec.experts(call)
            outs.append(call.output)
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    total = all_reduce_sum([o.cpu() for o in outs], torch_dtype(case))
    return total.to(torch_dtype(case)).to(outs[0].device)
