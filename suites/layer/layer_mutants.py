"""Planted stateful-layer bugs: our StatefulMoELoRALayer wrong in one way that serving code with LoRA has
shipped (stale mappings, slots left live, cached or capture-time metadata, padding given an adapter, a base
path that changes with LoRA on, events reused across calls). Each is a layer-level backend the harness must
fail; CONTROL holds the same layers without a defect, which must pass. MECHANISMS says how each goes wrong
and SCENARIOS holds the short scripted scenario (harness.layer_scenario's step format) that shows it.

  moe-lora-harness check --backend moe_lora_harness.suites.layer.layer_mutants:MUTANTS ...
"""
from __future__ import annotations

import torch

from moe_lora_harness.backends.layer import LAYER_DUAL_STREAM, layer_spec
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


def _spec(name: str, doc: str, *, layer_cls=None, experts_cls=TritonExperts, origin=ORIGIN, precision=None):
    return layer_spec(name, experts_cls, " ".join(doc.split()), layer_cls=layer_cls, origin=origin,
                      precision=precision)


_DEFECTS = {   # short name: (layer class, experts class)
    "stale-mapping": (StaleMapping, TritonExperts),
    "unload-leaves-live": (UnloadLeavesSlotLive, TritonExperts),
    "reload-no-zero": (ReloadWithoutZeroing, TritonExperts),
    "metadata-cached": (MetadataCached, TritonExperts),
    "capture-time-metadata": (CaptureTimeMetadata, TritonExperts),
    "padding-right-aligned": (PaddingRightAligned, TritonExperts),
    "split-k-with-lora": (None, SplitKWithLoRA),
    "dual-stream-event-reuse": (None, EventReuseExperts),
}

MECHANISMS = {
    f"layer-mutant-{short}": " ".join(((layer or experts).__doc__ or "").split())
    for short, (layer, experts) in _DEFECTS.items()}

MUTANTS = [
    _spec(f"layer-mutant-{short}", MECHANISMS[f"layer-mutant-{short}"], layer_cls=layer, experts_cls=experts,
          precision=LAYER_DUAL_STREAM.precision if issubclass(experts, DualStreamTritonExperts) else None)
    for short, (layer, experts) in _DEFECTS.items()]

CONTROL = [
    _spec("layer-control", "no defect: StatefulMoELoRALayer over TritonExperts", origin=CONTROL_ORIGIN),
    _spec("layer-control-dual-stream", "no defect: StatefulMoELoRALayer over DualStreamTritonExperts",
          experts_cls=DualStreamTritonExperts, origin=CONTROL_ORIGIN, precision=LAYER_DUAL_STREAM.precision),
]
BACKENDS = [*MUTANTS, *CONTROL]     # selftest's layer corpus (each spec keeps the origin it loads by)
CONTROL_FOR = {s.name: ("layer-control-dual-stream" if "dual-stream" in s.name else "layer-control")
               for s in MUTANTS}


# ----------------------------------------------------------------------------- the scenario each defect shows on


def _load(slot, rank, seed):
    return {"do": "load", "slot": slot, "rank": rank, "seed": seed}


def _fwd(mapping, seed):
    return {"do": "forward", "mapping": list(mapping), "seed": seed}


SCENARIOS = {
    "layer-mutant-stale-mapping": [_load(0, 8, 1), _fwd([0, 0, 0, 0], 2), _fwd([-1, -1, -1, -1], 3)],
    "layer-mutant-unload-leaves-live": [_load(0, 8, 1), {"do": "unload", "slot": 0}, _fwd([0, 0, -1, 0], 2)],
    "layer-mutant-reload-no-zero": [_load(0, 8, 1), _load(0, 2, 4), _fwd([0, 0, 0, 0], 2)],
    "layer-mutant-metadata-cached": [_load(0, 8, 1), _fwd([0, -1, 0, -1], 2), _fwd([-1, 0, -1, 0], 3)],
    "layer-mutant-capture-time-metadata": [_load(0, 8, 1), {"do": "capture", "size": 4},
                                           {"do": "replay", "size": 4, "mapping": [0, 0, 0, 0], "seed": 2}],
    "layer-mutant-padding-right-aligned": [_load(0, 8, 1), {"do": "capture", "size": 4},
                                           {"do": "replay", "size": 4, "mapping": [0, -1], "seed": 2}],
    "layer-mutant-split-k-with-lora": [_load(0, 8, 1), _fwd([-1, 0, -1, -1, 0, -1, -1, -1], 2)],
    "layer-mutant-dual-stream-event-reuse": [_load(0, 8, 1), _fwd([0, -1, 0, -1], 2), _fwd([0, 0, -1, -1], 3)],
}

# the named scenario (harness.layer_scenarios, check's layer rows) each planted bug fails first: the suite runs
# that row alone (check runs them all, so failing it is failing check); selftest runs every row
FAILS_NAMED = {
    "layer-mutant-stale-mapping": "layer: adapter, then base-model tokens (#42008)",
    "layer-mutant-unload-leaves-live": "layer: unloaded slot still in the mapping",
    "layer-mutant-reload-no-zero": "layer: smaller rank into a used slot",
    "layer-mutant-metadata-cached": "layer: adapter, then base-model tokens (#42008)",
    "layer-mutant-capture-time-metadata": "layer: graph: capture, replay with new contents and adapters",
    "layer-mutant-padding-right-aligned": "layer: graph: a padded replay after a full batch",
    "layer-mutant-split-k-with-lora": "layer: adapter, then base-model tokens (#42008)",
    "layer-mutant-dual-stream-event-reuse": "layer: adapter, then base-model tokens (#42008)",
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
}
