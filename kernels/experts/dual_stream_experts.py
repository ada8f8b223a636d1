"""`DualStreamTritonExperts`: TritonExperts whose LoRA deltas run on an aux stream (spec 5, dual-stream mode).

Used when `lora_ctx.dual_stream` is set, the LoRA is not fully sharded (vLLM keeps the fully-sharded
path on one stream) and the batch has at most `lora_ctx.dual_stream_max_tokens` tokens (measured: above
that the aux stream competes with base GEMMs that already fill the GPU); otherwise it is plain
TritonExperts. The schedule (aux stream + four events) is created once per experts object, on its first dual-stream call, and reused: on CUDA a CudaSchedule
(adopting `lora_ctx.aux_stream` / `lora_ctx.events` when the layer provides them), on the CPU a
Recorder, which also checks every call for races and raises if it finds one.
Numerics: each delta is computed with add_inputs=False into a zeroed buffer and added on main,
so cache = rnd(cache + rnd(delta)) (reference precision "dual_stream" / "dual_stream_small_batch").
"""
from __future__ import annotations

import torch

from moe_lora_harness.kernels.experts.dual_stream import AUX, EVENTS, PLANS, Plan, dual_stream_program, run_program
from moe_lora_harness.kernels.experts.lora_context import DUAL_STREAM_MAX_TOKENS, MoELoRAContext
from moe_lora_harness.kernels.experts.triton_experts import ExpertsPlan, TritonExperts
from moe_lora_harness.kernels.schedule.interface import Schedule
from moe_lora_harness.kernels.schedule.recorder import Recorder


class _TritonPhases:
    """TritonExperts' phase methods bound to one call, in the executor's ExpertPhases shape."""

    def __init__(self, experts: TritonExperts, plan: ExpertsPlan, ctx: MoELoRAContext, x: torch.Tensor):
        self.experts, self.plan, self.ctx, self.x = experts, plan, ctx, x

    def base_w13(self, hidden, cache1):
        self.experts.base_w13(self.plan, self.x, cache1)     # the prepared input (router weight applied)

    def lora_w13(self, hidden, delta1):
        self.experts.lora_w13(self.plan, self.ctx, hidden, delta1, add_inputs=False)

    def add_w13_delta(self, cache1, delta1):
        cache1.add_(delta1)

    def activation(self, cache1, cache2):
        self.experts.activation(self.plan, cache1, cache2)

    def base_w2(self, cache2, cache3):
        self.experts.base_w2(self.plan, cache2, cache3)

    def lora_w2(self, cache2, delta2):
        self.experts.lora_w2(self.plan, self.ctx, cache2, delta2, add_inputs=False)

    def add_w2_delta(self, cache3, delta2):
        cache3.add_(delta2)

    def moe_sum(self, cache3, out):
        self.experts.moe_sum(self.plan, cache3, out)


class DualStreamTritonExperts(TritonExperts):
    """TritonExperts with the dual-stream schedule of kernels.experts.dual_stream.

    `program_for(plan)` is the program each call issues (tests replace it to plant bugs);
    `poison_workspace` (None = torch.empty) fills the delta buffers before each call so a missing zeroing
    shows as a wrong answer even where fresh memory happens to be zero.
    """

    name = "triton_experts_dual_stream"

    def __init__(self, config):
        super().__init__(config)
        self.dual_stream_schedule: Schedule | None = None
        self.poison_workspace: float | None = None
        self.last_plan: str | None = None

    @staticmethod
    def dual_stream_applies(fully_sharded: bool, num_tokens: int | None,
                            max_tokens: int | None = DUAL_STREAM_MAX_TOKENS) -> bool:
        """The gate alone: no fully-sharded collectives, and a batch of at most `max_tokens` tokens (larger
        ones fill the GPU with the base GEMMs alone; None: any batch)."""
        return not fully_sharded and (max_tokens is None or num_tokens is None or num_tokens <= max_tokens)

    @classmethod
    def uses_dual_stream(cls, ctx: MoELoRAContext | None, num_tokens: int | None = None) -> bool:
        """Dual-stream runs need LoRA with ctx.dual_stream set and the gate open for this batch."""
        return (ctx is not None and ctx.dual_stream
                and cls.dual_stream_applies(ctx.fully_sharded, num_tokens, ctx.dual_stream_max_tokens))

    def program_for(self, plan: Plan):
        """The Steps a call issues for `plan` (kernels.experts.dual_stream.dual_stream_program)."""
        return dual_stream_program(plan)

    def schedule_for(self, device: torch.device, ctx: MoELoRAContext) -> Schedule:
        """The layer's schedule, created on first use and kept (one aux stream, four events per layer)."""
        if self.dual_stream_schedule is None:
            if device.type == "cuda":
                from moe_lora_harness.kernels.schedule.cuda import CudaSchedule
                streams = {AUX: ctx.aux_stream} if ctx.aux_stream is not None else None
                events = None
                if ctx.events is not None:
                    if len(ctx.events) != len(EVENTS):
                        raise ValueError(f"lora_ctx.events must hold {len(EVENTS)} events {EVENTS}; "
                                         f"got {len(ctx.events)}")
                    events = dict(zip(EVENTS, ctx.events))
                self.dual_stream_schedule = CudaSchedule(device, streams=streams, events=events)
            else:
                self.dual_stream_schedule = Recorder()
            self.dual_stream_schedule.stream(AUX)          # created now, not lazily (e.g. inside a graph capture)
            for e in EVENTS:
                self.dual_stream_schedule.event(e)
        return self.dual_stream_schedule

    @staticmethod
    def batch_plan(ctx: MoELoRAContext) -> str:
        """'no_lora' when a host-visible mapping shows no token with an enabled adapter, else 'both'.

        A mapping on the GPU is not read (that would sync the host): the LoRA kernels skip -1 tokens.
        """
        m = ctx.mapping
        if m.device.type == "cpu" and ctx.adapter_enabled.device.type == "cpu":
            en = ctx.adapter_enabled.long()
            lid = m.long()
            live = (lid >= 0) & (en[lid.clamp(min=0)] != 0)
            if not bool(live.any()):
                return "no_lora"
        return "both"

    def apply(self, output, hidden_states, w13, w2, topk_weights, topk_ids, *, expert_map=None,
              w13_bias=None, w2_bias=None, lora_ctx: MoELoRAContext | None = None) -> None:
        """As TritonExperts.apply; with ctx.dual_stream (not fully sharded) the LoRA deltas run on the aux stream."""
        if not self.uses_dual_stream(lora_ctx, int(hidden_states.shape[0])):
            return super().apply(output, hidden_states, w13, w2, topk_weights, topk_ids, expert_map=expert_map,
                                 w13_bias=w13_bias, w2_bias=w2_bias, lora_ctx=lora_ctx)
        plan = self.make_plan(output, hidden_states, w13, w2, topk_weights, topk_ids, expert_map=expert_map,
                              w13_bias=w13_bias, w2_bias=w2_bias, lora_ctx=lora_ctx)
        if plan.T == 0:
            return
        sched = self.schedule_for(hidden_states.device, lora_ctx)
        x_lora = lora_ctx.w13_lora_input(hidden_states)
        cache1, cache2, cache3 = self.workspaces(plan)
        if self.poison_workspace is None:
            delta1, delta2 = torch.empty_like(cache1), torch.empty_like(cache3)
        else:
            delta1 = torch.full_like(cache1, self.poison_workspace)
            delta2 = torch.full_like(cache3, self.poison_workspace)
        buffers = dict(hidden=x_lora, topk_ids=topk_ids, topk_weights=topk_weights, cache1=cache1, delta1=delta1,
                       cache2=cache2, cache3=cache3, delta2=delta2, out=output)
        self.last_plan = self.batch_plan(lora_ctx)
        run_program(sched, self.program_for(PLANS[self.last_plan]), _TritonPhases(self, plan, lora_ctx, hidden_states),
                    buffers)
        if isinstance(sched, Recorder):
            sched.assert_clean()
