"""Planted expert-parallel bugs: our Triton experts under the naive EP prepare/finalize, each wrong in one way
that real EP + LoRA code has shipped. Each is a backend the harness must fail under both EP drivers
(simulated ranks and processes); `ep-control` is the same layer without a defect and must pass.
`suites/experts/test_ep_harness.py` holds them to that; `CASES` names the case each defect shows on.

  moe-lora-harness check --backend moe_lora_harness.suites.experts.ep_mutants:MUTANTS --feature "experts: EP 2 ..."
"""
from __future__ import annotations

import dataclasses

import torch

from moe_lora_harness.backends.experts import (
    apply_experts, capabilities_of, config_from_call, context_from_call, precision_for)
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.contract import BackendSpec
from moe_lora_harness.kernels.experts.ep_prepare_finalize import NaiveEPPrepareAndFinalize, slice_lora_to_local
from moe_lora_harness.kernels.experts.lora_mixin import build_lora_alignment
from moe_lora_harness.kernels.experts.triton_experts import TritonExperts


# ----------------------------------------------------------------------------- defects in the prepare/finalize


class OwnMapping(NaiveEPPrepareAndFinalize):
    """The gathered batch gets this rank's own tokens' mapping (cycled), not the dispatched one."""

    def prepare(self, hidden_states, topk_weights, topk_ids, config, *, lora_ctx=None):
        out = super().prepare(hidden_states, topk_weights, topk_ids, config, lora_ctx=lora_ctx)
        if lora_ctx is not None:
            own, Tg = lora_ctx.token_lora_mapping, int(out[1].shape[0])
            idx = torch.arange(Tg, device=own.device) % max(1, own.shape[0])
            lora_ctx.local_token_lora_mapping = (own[idx] if own.shape[0] else
                                                 torch.full((Tg,), -1, dtype=torch.int32, device=own.device))
        return out


class MappingFromStart(NaiveEPPrepareAndFinalize):
    """Each source rank's mapping chunk cut [:num_local_tokens] from the start of the gathered mapping, not
    at its offset (the sequence-parallel trap: right for rank 0's tokens only)."""

    def prepare(self, hidden_states, topk_weights, topk_ids, config, *, lora_ctx=None):
        out = super().prepare(hidden_states, topk_weights, topk_ids, config, lora_ctx=lora_ctx)
        if lora_ctx is not None:
            g = lora_ctx.local_token_lora_mapping
            lora_ctx.local_token_lora_mapping = torch.cat([g[:n] for n in self.tokens_per_rank]).contiguous()
        return out


class CombineTwice(NaiveEPPrepareAndFinalize):
    """The combine all-reduces, then reduce-scatters the already-summed output again (sums twice)."""

    def finalize(self, output, config):
        sizes = list(self.tokens_per_rank)
        mine = super().finalize(output, config)
        full = self.comm.all_gather([mine])[0]
        return self.comm.reduce_scatter(full, sizes)


class CombineDropsRank(NaiveEPPrepareAndFinalize):
    """The combine sums every rank's partial output but the last one's."""

    def finalize(self, output, config):
        sizes, self.tokens_per_rank = self.tokens_per_rank, None
        parts = self.comm.all_gather([output.unsqueeze(0)])[0]     # (ep, T, H)
        total = parts[:-1].float().sum(0).to(output.dtype)
        lo = sum(sizes[:self.comm.rank])
        return total[lo:lo + sizes[self.comm.rank]]


class ExpertMapOffByOne(NaiveEPPrepareAndFinalize):
    """The last rank's expert map starts one expert early (it takes its neighbour's last expert, drops its own)."""

    def __init__(self, comm, num_experts_global, **kw):
        super().__init__(comm, num_experts_global, **kw)
        if comm.rank == comm.size - 1:
            n = self.local_num_experts
            start = comm.rank * n - 1
            emap = torch.full((num_experts_global,), -1, dtype=torch.int32)
            emap[start:start + n] = torch.arange(n, dtype=torch.int32)
            self.expert_map = emap


# ----------------------------------------------------------------------------- defects in the experts / loading


class LoRAIdsFromLocalTokens(TritonExperts):
    """The active adapters (lora_ids) are taken from this rank's own tokens, not the dispatched batch, so an
    adapter used only by another rank's tokens is skipped."""

    name = "ep_mutant_lora_ids"

    def lora_alignment(self, ctx, topk_ids, *, expert_map):
        align = build_lora_alignment(ctx, topk_ids, expert_map=expert_map)
        own = ctx.token_lora_mapping
        used = [int(v) for v in torch.unique(own[own >= 0]).tolist()] if own.numel() else []
        ids = torch.full_like(align.lora_ids, -1)
        ids[:len(used)] = torch.tensor(used, dtype=ids.dtype)
        return dataclasses.replace(align, lora_ids=ids)


def _run(call, *, pf_cls=NaiveEPPrepareAndFinalize, experts_cls=TritonExperts, lora_rank=None,
         ignore_fully_sharded=False):
    """Our EP layer on one rank's call, with the given defect (prepare/finalize class, experts class, the
    rank whose experts the LoRA is sliced for, or fully_sharded dropped at construction)."""
    if call.ep_comm is None:
        raise ValueError("EP mutants run only dispatched EP cases (ExpertCall.ep_comm)")
    fs = bool(call.fully_sharded) and not ignore_fully_sharded
    pf = pf_cls(call.ep_comm, call.num_experts_global, fully_sharded=fs)
    if ignore_fully_sharded:
        call = dataclasses.replace(call, fully_sharded=False)
    config = config_from_call(call)
    if lora_rank is not None and call.w13_lora_a is not None:   # slice the LoRA for another rank's experts
        a13, b13, a2, b2 = slice_lora_to_local(call.w13_lora_a, call.w13_lora_b, call.w2_lora_a, call.w2_lora_b,
                                               ep_rank=lora_rank(call), ep_size=call.ep_size,
                                               num_experts_global=call.num_experts_global)
        ctx = context_from_call(dataclasses.replace(call, w13_lora_a=a13, w13_lora_b=b13, w2_lora_a=a2,
                                                    w2_lora_b=b2, ep_comm=None), config)
    else:
        ctx = context_from_call(call, config)
    apply_experts(call, experts_cls(config), ctx, (pf, pf.expert_map.to(call.hidden_states.device)))


def _spec(name: str, description: str, **defect) -> BackendSpec:
    return BackendSpec(name=name, description=description, capabilities=capabilities_of(TritonExperts),
                       experts=lambda call: _run(call, **defect), precision=precision_for(TritonExperts))


CONTROL = _spec("ep-control", "no defect: TritonExperts under NaiveEPPrepareAndFinalize")
MUTANTS = [
    CONTROL,
    _spec("ep-own-mapping", OwnMapping.__doc__, pf_cls=OwnMapping),
    _spec("ep-mapping-from-start", MappingFromStart.__doc__, pf_cls=MappingFromStart),
    _spec("ep-lora-ids-local", LoRAIdsFromLocalTokens.__doc__, experts_cls=LoRAIdsFromLocalTokens),
    _spec("ep-lora-slice-global-index", "the LoRA sliced at expert 0 on every rank (global index, no rank offset)",
          lora_rank=lambda call: 0),
    _spec("ep-lora-slice-next-rank", "the LoRA sliced for the next rank's experts (offset off by one rank)",
          lora_rank=lambda call: (call.ep_rank + 1) % call.ep_size),
    _spec("ep-combine-twice", CombineTwice.__doc__, pf_cls=CombineTwice),
    _spec("ep-combine-drops-rank", CombineDropsRank.__doc__, pf_cls=CombineDropsRank),
    _spec("ep-expert-map-off-by-one", ExpertMapOffByOne.__doc__, pf_cls=ExpertMapOffByOne),
    _spec("ep-accepts-fully-sharded", "EP with fully-sharded LoRA silently accepted (run as if not fully sharded)",
          ignore_fully_sharded=True),
]

# The case each defect shows on (ep_comm is set by the driver under test); by_rank: every adapter is used
# by one rank's tokens only, so each rank must run the others' adapters for them.
_BASE = Case(level="expert", T=7, H=32, I=32, E=4, top_k=2, dtype="float32", max_loras=2, max_rank=8,
             mapping="by_rank", ep_size=2, ep_tokens=(3, 4), seed=17)
CASES = {m.name: _BASE for m in MUTANTS}
CASES["ep-accepts-fully-sharded"] = _BASE.replace(fully_sharded=True)


# ----------------------------------------------------------------------------- hostile ranks (behaviour, not numbers)


def _skips_collective(call):
    """Rank 1 returns without joining the dispatch; the other ranks must not wait forever."""
    if call.ep_rank != 1:
        _run(call)


def _rank_raises(call):
    """Rank 1 raises before any collective; the verdict must be its error, not the others' timeouts."""
    if call.ep_rank == 1:
        raise ValueError("planted failure on rank 1")
    _run(call)


def _rank_dies(call):
    """Rank 1's process exits (a crash of one rank)."""
    if call.ep_rank == 1:
        import os
        os._exit(7)
    _run(call)


def _hostile(name, fn):
    return BackendSpec(name=name, description=fn.__doc__, capabilities=capabilities_of(TritonExperts),
                       experts=fn, precision=precision_for(TritonExperts))


HOSTILE = [_hostile("ep-rank-skips-collective", _skips_collective), _hostile("ep-rank-raises", _rank_raises),
           _hostile("ep-rank-dies", _rank_dies)]
