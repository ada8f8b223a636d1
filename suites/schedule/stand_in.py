"""The dual-stream program of kernels.experts.dual_stream with torch stand-in phases, for the schedule suites
(test-only): the stand-in phases, a poisoned workspace, every program the executor can emit, and a run."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_lora_harness.kernels.experts.dual_stream import (
    PLANS, ExpertPhases, Plan, Step, dual_stream_program, run_program,
)
from moe_lora_harness.kernels.schedule.interface import Schedule

POISON = 3.0                  # fill of a fresh workspace: a delta buffer that is not zeroed gives a wrong answer


def all_programs() -> dict[str, tuple[Step, ...]]:
    """Every schedule the executor can emit, by plan name (what CI checks with the Recorder)."""
    return {name: dual_stream_program(plan) for name, plan in PLANS.items()}


def run_dual_stream(sched: Schedule, phases: ExpertPhases, buffers: dict, plan: Plan | str = "both") -> torch.Tensor:
    """Run the expert layer with its LoRA deltas on the aux stream; returns buffers["out"].

    `buffers`: INPUTS (hidden (T, H), topk_ids, topk_weights) and "out" (T, H) from the caller, plus the
    WORKSPACE from `allocate_workspace` (reused across calls is fine: every reuse is ordered).
    """
    run_program(sched, dual_stream_program(plan), phases, buffers)
    return buffers["out"]


def allocate_workspace(T: int, k: int, N1: int, I: int, H: int, dtype: torch.dtype, device,
                       poison: float = POISON) -> dict:
    """Workspace buffers, filled with a non-zero `poison` so a missing zeroing shows as a wrong answer."""
    for name, v in (("T", T), ("k", k), ("N1", N1), ("I", I), ("H", H)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "T" else 1):
            raise ValueError(f"{name} must be an int >= {0 if name == 'T' else 1}; got {v!r}")
    shapes = {"cache1": (T, k, N1), "delta1": (T, k, N1), "cache2": (T * k, I), "cache3": (T, k, H),
              "delta2": (T, k, H)}
    return {n: torch.full(s, poison, dtype=dtype, device=device) for n, s in shapes.items()}


class TorchPhases:
    """Torch stand-in for the Triton phases: same contract and rounding points, plain torch ops.

    silu-and-mul (gated) or silu_no_mul; LoRA writes only pairs whose token maps to a slot >= 0 with an
    enabled adapter; rank intermediate rounded to dt, fp32 accumulation, w2 delta weighted in fp32.
    Lets the executor, the recorder and the planted bugs be tested without Triton (and on any GPU).
    """

    def __init__(self, w13, w2, topk_weights, topk_ids, *, lora=None, token_lora_mapping=None,
                 adapter_enabled=None, gated: bool = True):
        self.w13, self.w2, self.gated = w13, w2, gated
        self.k = int(topk_ids.shape[1])
        self.e = topk_ids.reshape(-1).long()
        self.w = topk_weights.reshape(-1).float()
        self.tok = torch.arange(self.e.numel(), device=topk_ids.device) // self.k
        self.lora = lora   # (w13_a list, w13_b list, w2_a (L,E,R,I), w2_b (L,E,H,R)) or None
        if lora is not None:
            lid = token_lora_mapping.long()[self.tok]
            ok = lid >= 0
            if adapter_enabled is not None:
                ok = ok & (adapter_enabled.long()[lid.clamp(min=0)] != 0)
            self.lid, self.ok = lid.clamp(min=0), ok.unsqueeze(1)

    def _gemm(self, x, w):       # x (P, K) dt, w (P, N, K) dt -> fp32 (P, N)
        return torch.einsum("pk,pnk->pn", x.float(), w.float())

    def _delta(self, x, a, b, out, weight=None):
        dt = out.dtype
        u = self._gemm(x, a[self.lid, self.e]).to(dt)
        d = self._gemm(u, b[self.lid, self.e])
        if weight is not None:
            d = d * weight.unsqueeze(1)
        out.copy_(torch.where(self.ok, d.to(dt), out))

    def base_w13(self, hidden, cache1):
        cache1.view(self.e.numel(), -1).copy_(self._gemm(hidden[self.tok], self.w13[self.e]).to(cache1.dtype))

    def lora_w13(self, hidden, delta1):
        a13, b13 = self.lora[0], self.lora[1]
        flat = delta1.view(self.e.numel(), -1)
        n = b13[0].shape[2]
        for s in range(len(a13)):
            self._delta(hidden[self.tok], a13[s], b13[s], flat[:, s * n:(s + 1) * n])

    def add_w13_delta(self, cache1, delta1):
        cache1.add_(delta1)

    def activation(self, cache1, cache2):
        c = cache1.view(self.e.numel(), -1).float()
        if not self.gated:
            cache2.copy_(F.silu(c).to(cache2.dtype))
            return
        i = c.shape[1] // 2
        cache2.copy_((F.silu(c[:, :i]).to(cache2.dtype).float() * c[:, i:]).to(cache2.dtype))

    def base_w2(self, cache2, cache3):
        acc = self._gemm(cache2, self.w2[self.e]) * self.w.unsqueeze(1)
        cache3.view(self.e.numel(), -1).copy_(acc.to(cache3.dtype))

    def lora_w2(self, cache2, delta2):
        self._delta(cache2, self.lora[2], self.lora[3], delta2.view(self.e.numel(), -1), weight=self.w)

    def add_w2_delta(self, cache3, delta2):
        cache3.add_(delta2)

    def moe_sum(self, cache3, out):
        out.copy_(cache3.float().sum(dim=1).to(out.dtype))
