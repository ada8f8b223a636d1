"""Planted stateful-layer bugs: our StatefulMoELoRALayer (or its contract adapter, backends.layer.ContractLayer)
wrong in one way that serving code with LoRA has shipped (stale mappings, slots left live, cached or capture-time
metadata, a base path that changes with LoRA on, events reused across calls; w2 loaded with w13's rank or scaling,
a slot's rank fixed at its first load, reloads after an unload, a dummy zero-token replay, padding that reaches
real rows, factors cast to one dtype whatever the layer's). Each is a layer-level backend the harness must fail; CONTROL holds the same layers without a defect,
which must pass. MECHANISMS says how each goes wrong and SCENARIOS holds the short scripted scenario
(harness.build.layer_scenario's step format) that shows it.

  moe-lora-harness check --backend moe_lora_harness.suites.layer.layer_mutants:MUTANTS ...
"""
from __future__ import annotations

import dataclasses

import torch

from moe_lora_harness.backends.layer import LAYER_DUAL_STREAM, ContractLayer, layer_spec, make_factory
from moe_lora_harness.harness.build.layer_scenario import (forward_step as _fwd, load_step as _load,
                                                          replay_step as _replay)
from moe_lora_harness.kernels.experts.dual_stream import AUX, dual_stream_program
from moe_lora_harness.kernels.experts.dual_stream_experts import DualStreamTritonExperts
from moe_lora_harness.kernels.experts.triton_experts import TritonExperts
from moe_lora_harness.kernels.layer.stateful import StatefulMoELoRALayer
from moe_lora_harness.kernels.schedule.interface import MAIN
from moe_lora_harness.kernels.triton.fused_moe_gemm import fused_moe_gemm

ORIGIN = "moe_lora_harness.suites.layer.layer_mutants:MUTANTS"
CONTROL_ORIGIN = "moe_lora_harness.suites.layer.layer_mutants:CONTROL"


# ----------------------------------------------------------------------------- defects of the layer


class StaleMapping(StatefulMoELoRALayer):
    """set_mapping writes only the tokens that have an adapter: a -1 entry keeps the previous batch's slot."""

    def _write_mapping(self, mapping, T):
        old = self._mapping[:T]
        old.copy_(torch.where(mapping >= 0, mapping, old))


class UnloadLeavesSlotLive(StatefulMoELoRALayer):
    """reset_lora only forgets the slot on the host: adapter_enabled stays 1 and the factors stay loaded."""

    def reset_lora(self, index):
        self._need_lora("reset_lora")
        self._check_slot(index)


class ReloadWithoutZeroing(StatefulMoELoRALayer):
    """set_lora copies the new rank into the slot's corner without zeroing it first: a smaller rank loaded over
    a larger one keeps the old adapter's tail (ranks r..R-1)."""

    _loading = False

    def set_lora(self, index, w13_a, w13_b, w2_a, w2_b):
        self._loading = True
        try:
            super().set_lora(index, w13_a, w13_b, w2_a, w2_b)
        finally:
            self._loading = False

    def _zero_slot(self, index):
        if not self._loading:
            super()._zero_slot(index)


class MetadataCached(StatefulMoELoRALayer):
    """The per-batch LoRA metadata is computed on the first forward and cached: later batches run with the
    first batch's token -> slot metadata."""

    _cached = False

    def _update_metadata(self, T):
        if not self._cached:
            super()._update_metadata(T)
            self._cached = True
        self.lora_ctx.token_lora_mapping = self._token_lora[:T]


class CaptureTimeMetadata(StatefulMoELoRALayer):
    """The graph runs over LoRA metadata computed at capture time (outside the graph): every replay reads the
    capture-time mapping, not the one set for the replayed batch."""

    def _graph_body(self, size):
        if self.lora_ctx is None:
            return super()._graph_body(size)
        self._update_metadata(size)
        frozen = self._token_lora[:size].clone()

        def body():
            self.lora_ctx.token_lora_mapping = frozen
            self._apply(size)
        return body


class PaddingRightAligned(StatefulMoELoRALayer):
    """A padded replay writes its T tokens' mapping at the end of the captured batch (the padding first): real rows
    read the padding's -1 or another token's slot."""

    def _pad_mapping(self, T, S):
        real = self._mapping[:T].clone()
        self._mapping[:S - T].fill_(-1)
        self._mapping[S - T:S].copy_(real)


class SlotKeepsFirstRank(StatefulMoELoRALayer):
    """A slot's rank is fixed at its first load (the rank the kernels loop to per slot): a larger rank loaded into
    a slot that held a smaller one is cut to the smaller."""

    def set_lora(self, index, w13_a, w13_b, w2_a, w2_b):
        r = self.__dict__.setdefault("_first_rank", {}).setdefault(index, int(w2_a.shape[1]))
        super().set_lora(index, [a[:, :r] for a in w13_a], [b[..., :r] for b in w13_b], w2_a[:, :r], w2_b[..., :r])


class ReloadStaysDisabled(StatefulMoELoRALayer):
    """set_lora enables a slot only when it first allocates it, reset_lora disables it: an adapter loaded into a
    slot after an unload is copied in but stays disabled (its tokens get no adapter)."""

    def set_lora(self, index, *factors):
        freed = index in self.__dict__.setdefault("_freed", set())
        super().set_lora(index, *factors)
        if freed:
            self.adapter_enabled[index] = 0

    def reset_lora(self, index):
        super().reset_lora(index)
        self.__dict__.setdefault("_freed", set()).add(index)


class ZeroTokenReplayDeactivates(StatefulMoELoRALayer):
    """A replay with no real token (a data-parallel dummy batch at a captured size) deactivates every slot so its
    padding reads no adapter, and leaves them so: the next batch's tokens get no adapter."""

    def replay(self, hidden_states, topk_weights, topk_ids):
        if self.lora_ctx is not None and self._num_tokens == 0:
            self.adapter_enabled.zero_()
        return super().replay(hidden_states, topk_weights, topk_ids)


class UnpaddedMapping(StatefulMoELoRALayer):
    """No defect (vLLM's padding): a padded replay's padding rows keep whatever the mapping buffer held (the last
    batch's slots); their outputs are discarded."""

    def _pad_mapping(self, T, S):
        pass


class PaddingDeltaLeaks(UnpaddedMapping):
    """A padded replay's LoRA expand scatters by token index modulo the real count: each padding row's LoRA delta
    (its slot the last batch's, as in vLLM) is added to real row t mod T as well."""

    def replay(self, hidden_states, topk_weights, topk_ids):
        out = super().replay(hidden_states, topk_weights, topk_ids)
        S, T = out.shape[0], self._num_tokens
        if self.lora_ctx is None or not T or T == S:
            return out
        self._token_lora[:S].fill_(-1)            # the same rows without LoRA: the padding rows' delta
        self.lora_ctx.token_lora_mapping = self._token_lora[:S]
        self._apply(S)
        return out.index_add_(0, torch.arange(T, S, device=out.device) % T, out[T:] - self._out[T:S])


# ----------------------------------------------------------------------------- defects of the contract adapter


class W2ScaledLikeW13(ContractLayer):
    """load_adapter folds the w13 modules' scaling into w2's B too: the down module's own scaling (PEFT's
    alpha / r at its rank) is ignored."""

    def load_adapter(self, slot, adapter):
        super().load_adapter(slot, dataclasses.replace(adapter, down_scaling=None))


class W13RankFromDown(ContractLayer):
    """load_adapter reads the slot's rank from the down (w2) factors: gate_up factors of a larger rank (PEFT's 2r
    beside down's r) are cut to it."""

    def load_adapter(self, slot, adapter):
        r = adapter.w2_rank
        cut = {f: None if t is None else (t[:, :r] if f.endswith("_a") else t[..., :r])
               for f, t in (("gate_a", adapter.gate_a), ("gate_b", adapter.gate_b),
                            ("up_a", adapter.up_a), ("up_b", adapter.up_b))}
        super().load_adapter(slot, dataclasses.replace(adapter, **cut))


class SameAdapterReloadSkipped(ContractLayer):
    """load_adapter skips loading the adapter a slot already holds, and unload_adapter does not forget what the
    slot held: the same adapter loaded again after an unload is skipped, and the slot stays empty."""

    def load_adapter(self, slot, adapter):
        held = self.__dict__.setdefault("_held", {})
        if slot in held and _same_adapter(held[slot], adapter):
            return
        held[slot] = adapter
        super().load_adapter(slot, adapter)


class FactorsInHalf(ContractLayer):
    """load_adapter casts the factors to float16 (a dtype written where the layer's was meant) before the layer's
    cast: right in a float16 layer, the factors rounded to half precision in any other (the every-dtype family:
    a search of the first dtype claimed alone misses it)."""

    def load_adapter(self, slot, adapter):
        half = {f.name: v.to(torch.float16) for f in dataclasses.fields(adapter)
                for v in [getattr(adapter, f.name)] if isinstance(v, torch.Tensor) and v.is_floating_point()}
        super().load_adapter(slot, dataclasses.replace(adapter, **half))


def _same_adapter(a, b) -> bool:
    """Whether two ExpertAdapters hold the same factors and scalings."""
    pairs = [(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)]
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
               for x, y in pairs)


class SplitKWithLoRA(TritonExperts):
    """With LoRA enabled the base w13 GEMM is split over K (two partial GEMMs added in the working dtype), another
    base configuration than the LoRA-disabled layer's: the base output rounds differently, so tokens without an
    adapter are not bit-identical to the twin (#49063's symptom), though still within tolerance."""

    def base_w13(self, plan, x, out):
        if not self.config.lora_enabled:
            return super().base_w13(plan, x, out)
        h = plan.H // 2
        ids, eids, ntpp = plan.align
        common = dict(sorted_token_ids=ids, expert_ids=eids, num_tokens_post_padded=ntpp, top_k=plan.k,
                      x_row_div=plan.k, block_m=plan.block_m)
        part = torch.empty_like(out)
        fused_moe_gemm(part, x[:, :h].contiguous(), plan.w13[:, :, :h].contiguous(), **common)
        fused_moe_gemm(out, x[:, h:].contiguous(), plan.w13[:, :, h:].contiguous(), bias=plan.w13_bias, **common)
        out.add_(part)


class EventReuseExperts(DualStreamTritonExperts):
    """From its second call on, the aux stream's wait on x_ready is issued before main records this call's
    x_ready: it binds to the previous call's record, so this call's w13 delta is ordered only after the
    previous call's inputs and runs unordered against the previous call's w2 phase and this call's inputs."""

    def __init__(self, config):
        super().__init__(config)
        self.calls = 0

    def program_for(self, plan):
        steps = list(dual_stream_program(plan))
        self.calls += 1
        rec = next((i for i, s in enumerate(steps) if s.kind == "record" and s.stream == MAIN
                    and s.name == "x_ready"), None)
        if self.calls > 1 and rec is not None and steps[rec + 1].kind == "wait" and steps[rec + 1].stream == AUX:
            steps[rec], steps[rec + 1] = steps[rec + 1], steps[rec]
        return tuple(steps)


# ----------------------------------------------------------------------------- specs


def _spec(name: str, doc: str, *, layer_cls=None, experts_cls=TritonExperts, contract_cls=None, origin=ORIGIN,
          precision=None):
    spec = layer_spec(name, experts_cls, " ".join(doc.split()), layer_cls=layer_cls, origin=origin,
                      precision=precision)
    if contract_cls is None:
        return spec
    factory = make_factory(experts_cls, layer_cls)
    return dataclasses.replace(spec, layer=lambda config, weights: contract_cls(factory(config, weights).layer, config))


_DEFECTS = {   # short name: (layer class, experts class, contract adapter class)
    "stale-mapping": (StaleMapping, TritonExperts, None),
    "unload-leaves-live": (UnloadLeavesSlotLive, TritonExperts, None),
    "reload-no-zero": (ReloadWithoutZeroing, TritonExperts, None),
    "metadata-cached": (MetadataCached, TritonExperts, None),
    "capture-time-metadata": (CaptureTimeMetadata, TritonExperts, None),
    "split-k-with-lora": (None, SplitKWithLoRA, None),
    "dual-stream-event-reuse": (None, EventReuseExperts, None),
    "w2-scaled-like-w13": (None, TritonExperts, W2ScaledLikeW13),
    "w13-rank-from-down": (None, TritonExperts, W13RankFromDown),
    "slot-keeps-first-rank": (SlotKeepsFirstRank, TritonExperts, None),
    "reload-stays-disabled": (ReloadStaysDisabled, TritonExperts, None),
    "same-adapter-reload-skipped": (None, TritonExperts, SameAdapterReloadSkipped),
    "zero-token-replay-deactivates": (ZeroTokenReplayDeactivates, TritonExperts, None),
    "padding-right-aligned": (PaddingRightAligned, TritonExperts, None),
    "padding-delta-leaks": (PaddingDeltaLeaks, TritonExperts, None),
    "factors-in-half": (None, TritonExperts, FactorsInHalf),
}

MECHANISMS = {
    f"layer-mutant-{short}": " ".join(((contract or layer or experts).__doc__ or "").split())
    for short, (layer, experts, contract) in _DEFECTS.items()}

MUTANTS = [
    _spec(f"layer-mutant-{short}", MECHANISMS[f"layer-mutant-{short}"], layer_cls=layer, experts_cls=experts,
          contract_cls=contract,
          precision=LAYER_DUAL_STREAM.precision if issubclass(experts, DualStreamTritonExperts) else None)
    for short, (layer, experts, contract) in _DEFECTS.items()]

CONTROL = [
    _spec("layer-control", "no defect: StatefulMoELoRALayer over TritonExperts", origin=CONTROL_ORIGIN),
    _spec("layer-control-dual-stream", "no defect: StatefulMoELoRALayer over DualStreamTritonExperts",
          experts_cls=DualStreamTritonExperts, origin=CONTROL_ORIGIN, precision=LAYER_DUAL_STREAM.precision),
]
BACKENDS = [*MUTANTS, *CONTROL]     # selftest's layer corpus (each spec keeps the origin it loads by)
# vLLM's padding (no defect; outside selftest's corpus, whose controls are CONTROL): the padding mutants' layer
# without their defect, which must pass every named scenario
UNPADDED = _spec("layer-unpadded-mapping", UnpaddedMapping.__doc__, layer_cls=UnpaddedMapping,
                 origin="moe_lora_harness.suites.layer.layer_mutants:UNPADDED")
CONTROL_FOR = {f"layer-mutant-{short}": ("layer-control-dual-stream" if issubclass(experts, DualStreamTritonExperts)
                                         else UNPADDED.name if layer and issubclass(layer, UnpaddedMapping)
                                         else "layer-control") for short, (layer, experts, _) in _DEFECTS.items()}


# ----------------------------------------------------------------------------- the scenario each defect shows on


UNLOAD0, CAPTURE4, CAPTURE8 = {"do": "unload", "slot": 0}, {"do": "capture", "size": 4}, {"do": "capture", "size": 8}
FULL8 = _fwd([0] * 8, 2)     # a full batch, every token with an adapter: a padded replay's padding keeps its slots

SCENARIOS = {
    "layer-mutant-stale-mapping": [_load(0, 8, 1), _fwd([0, 0, 0, 0], 2), _fwd([-1, -1, -1, -1], 3)],
    "layer-mutant-unload-leaves-live": [_load(0, 8, 1), UNLOAD0, _fwd([0, 0, -1, 0], 2)],
    "layer-mutant-reload-no-zero": [_load(0, 8, 1), _load(0, 2, 4), _fwd([0, 0, 0, 0], 2)],
    "layer-mutant-metadata-cached": [_load(0, 8, 1), _fwd([0, -1, 0, -1], 2), _fwd([-1, 0, -1, 0], 3)],
    "layer-mutant-capture-time-metadata": [_load(0, 8, 1), CAPTURE4, _replay(4, [0, 0, 0, 0], 2)],
    "layer-mutant-padding-right-aligned": [_load(0, 8, 1), CAPTURE4, _replay(4, [0, -1], 2)],
    "layer-mutant-split-k-with-lora": [_load(0, 8, 1), _fwd([-1, 0, -1, -1, 0, -1, -1, -1], 2)],
    "layer-mutant-dual-stream-event-reuse": [_load(0, 8, 1), _fwd([0, -1, 0, -1], 2), _fwd([0, 0, -1, -1], 3)],
    "layer-mutant-w2-scaled-like-w13": [_load(0, 8, 1, w2_rank=4, scaling=0.5, w2_scaling=1.0), _fwd([0, -1, 0, 0], 2)],
    "layer-mutant-w13-rank-from-down": [_load(0, 8, 1, w2_rank=4), _fwd([0, -1, 0, 0], 2)],
    "layer-mutant-slot-keeps-first-rank": [_load(0, 1, 1), _fwd([0, 0, -1, 0], 2), _load(0, 8, 3), _fwd([0, -1, 0], 4)],
    "layer-mutant-reload-stays-disabled": [_load(0, 8, 1), UNLOAD0, _load(0, 4, 2), _fwd([0, 0, -1, 0], 3)],
    "layer-mutant-same-adapter-reload-skipped": [_load(0, 4, 1), UNLOAD0, _load(0, 4, 1), _fwd([0, 0, -1, 0], 2)],
    "layer-mutant-zero-token-replay-deactivates": [_load(0, 8, 1), CAPTURE4, _fwd([0, 0, -1, 0], 2),
                                                   _replay(4, [], 3), _fwd([0, -1, 0, 0], 4)],
    "layer-mutant-padding-delta-leaks": [_load(0, 8, 1), CAPTURE8, FULL8, _replay(8, [-1, -1, -1, 0, -1], 3)],
    "layer-mutant-factors-in-half": [_load(0, 8, 1), _fwd([0, -1, 0, 0], 2)],     # in a float32 layer
}

# a named scenario (harness.layer.layer_scenarios, check's layer rows) each planted bug fails, its family's: the suite
# runs that row alone (check runs them all, so failing it is failing check); selftest runs every row
FAILS_NAMED = {
    "layer-mutant-stale-mapping": "layer: adapter, then base-model tokens (#42008)",
    "layer-mutant-unload-leaves-live": "layer: unloaded slot still in the mapping",
    "layer-mutant-reload-no-zero": "layer: smaller rank into a used slot",
    "layer-mutant-metadata-cached": "layer: adapter, then base-model tokens (#42008)",
    "layer-mutant-capture-time-metadata": "layer: graph: capture, replay with new contents and adapters",
    "layer-mutant-split-k-with-lora": "layer: adapter, then base-model tokens (#42008)",
    "layer-mutant-dual-stream-event-reuse": "layer: adapter, then base-model tokens (#42008)",
    "layer-mutant-w2-scaled-like-w13": "layer: w13 and w2 of other ranks and scalings (PEFT: gate_up 2r, down r)",
    "layer-mutant-w13-rank-from-down": "layer: w13 and w2 of other ranks and scalings (PEFT: gate_up 2r, down r)",
    "layer-mutant-slot-keeps-first-rank": "layer: larger rank into a slot that held a smaller one",
    "layer-mutant-reload-stays-disabled": "layer: reload after an unload (another adapter, then the same again)",
    "layer-mutant-same-adapter-reload-skipped": "layer: reload after an unload (another adapter, then the same again)",
    "layer-mutant-zero-token-replay-deactivates": "layer: graph: a zero-token replay after a batch with live slots",
    "layer-mutant-padding-right-aligned": "layer: graph: a padded replay after a full batch",
    "layer-mutant-padding-delta-leaks": "layer: graph: a padded replay after a full batch",
    "layer-mutant-factors-in-half": "layer: adapter, then base-model tokens (#42008) [float32]",
}

# what each scenario shows: "not-neutral" (a token without an adapter differs from the twin), "out-of-bound"
# (beyond the reference's bound), "raises ScheduleError" (the CPU Recorder found a race)
SHOWS = {
    "layer-mutant-stale-mapping": "not-neutral",
    "layer-mutant-unload-leaves-live": "not-neutral",
    "layer-mutant-reload-no-zero": "out-of-bound",
    "layer-mutant-metadata-cached": "not-neutral",
    "layer-mutant-capture-time-metadata": "out-of-bound",
    "layer-mutant-padding-right-aligned": "out-of-bound",
    "layer-mutant-split-k-with-lora": "not-neutral",
    "layer-mutant-dual-stream-event-reuse": "raises ScheduleError",
    "layer-mutant-w2-scaled-like-w13": "out-of-bound",
    "layer-mutant-w13-rank-from-down": "out-of-bound",
    "layer-mutant-slot-keeps-first-rank": "out-of-bound",
    "layer-mutant-reload-stays-disabled": "out-of-bound",
    "layer-mutant-same-adapter-reload-skipped": "out-of-bound",
    "layer-mutant-zero-token-replay-deactivates": "out-of-bound",
    "layer-mutant-padding-delta-leaks": "not-neutral",
    "layer-mutant-factors-in-half": "out-of-bound",
}
