"""Dual-stream LoRA execution of the expert layer (spec 5, vLLM's VLLM_LORA_ENABLE_DUAL_STREAM=1).

The base w13 and w2 GEMMs stay on the caller's (main) stream; each LoRA delta is computed on an aux
stream with add_inputs=False into a freshly zeroed delta buffer, joined back by an event and added on
main (cache += delta), so the result is rnd(cache + rnd(delta)). Four events, each recorded once per
call: x_ready (main -> aux: the hidden states are ready), delta13_done (aux -> main), cache2_ready
(main -> aux: the activation output is ready), delta2_done (aux -> main). Every aux chain starts with a
wait, so the program is also CUDA-graph capturable.

The program is data (`dual_stream_program(plan)` -> Steps), run through a `kernels.schedule.Schedule`,
so CI can check every schedule the executor emits with the CPU Recorder.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from moe_lora_harness.kernels.schedule.interface import MAIN, Schedule, named

AUX = "aux"
EVENTS = ("x_ready", "delta13_done", "cache2_ready", "delta2_done")
INPUTS = ("hidden", "topk_ids", "topk_weights")
WORKSPACE = ("cache1", "delta1", "cache2", "cache3", "delta2")
BUFFERS = INPUTS + WORKSPACE + ("out",)
ALIGN = "alignments"          # a named resource: the base and LoRA alignments, built on main before the program


@dataclass(frozen=True)
class Plan:
    """Which LoRA deltas a call computes (each on the aux stream)."""

    lora_w13: bool
    lora_w2: bool


PLANS = {
    "both": Plan(True, True),
    "w13_only": Plan(True, False),
    "w2_only": Plan(False, True),
    "no_lora": Plan(False, False),
}


@dataclass(frozen=True)
class Step:
    """One operation of a program: kind launch|record|wait, the stream, the phase or event name."""

    kind: str
    stream: str
    name: str
    reads: tuple = ()
    writes: tuple = ()

    def __str__(self) -> str:
        if self.kind == "launch":
            return f"{self.stream}: {self.name}(reads={list(self.reads)}, writes={list(self.writes)})"
        return f"{self.stream}: {self.kind} {self.name}"


class ExpertPhases(Protocol):
    """The expert layer split at the points the schedule needs; each call writes its last argument in place.

    lora_w13 / lora_w2 write only the pairs that qualify (add_inputs=False) into a zeroed delta buffer;
    add_w13_delta / add_w2_delta do cache += delta in the working dtype (re-interleaving when needed).
    """

    def base_w13(self, hidden: torch.Tensor, cache1: torch.Tensor) -> None:
        """cache1 = rnd(x @ w13[e]^T (+ bias)) for every local pair (main stream)."""

    def lora_w13(self, hidden: torch.Tensor, delta1: torch.Tensor) -> None:
        """delta1 = w13 LoRA delta of the hidden states, qualifying pairs only (aux stream)."""

    def add_w13_delta(self, cache1: torch.Tensor, delta1: torch.Tensor) -> None:
        """cache1 += delta1 in the working dtype (main stream)."""

    def activation(self, cache1: torch.Tensor, cache2: torch.Tensor) -> None:
        """cache2 = act(cache1) (main stream)."""

    def base_w2(self, cache2: torch.Tensor, cache3: torch.Tensor) -> None:
        """cache3 = rnd(w * (cache2 @ w2[e]^T (+ bias))) (main stream)."""

    def lora_w2(self, cache2: torch.Tensor, delta2: torch.Tensor) -> None:
        """delta2 = weighted w2 LoRA delta of cache2, qualifying pairs only (aux stream)."""

    def add_w2_delta(self, cache3: torch.Tensor, delta2: torch.Tensor) -> None:
        """cache3 += delta2 in the working dtype (main stream)."""

    def moe_sum(self, cache3: torch.Tensor, out: torch.Tensor) -> None:
        """out = rnd(sum over a token's local pairs of cache3) (main stream)."""


def _launch(stream, name, reads=(), writes=()):
    return Step("launch", stream, name, tuple(reads), tuple(writes))


def dual_stream_program(plan: Plan | str = "both") -> tuple[Step, ...]:
    """The steps the executor issues for `plan` (a Plan or a PLANS key), in host issue order."""
    plan = PLANS[plan] if isinstance(plan, str) and plan in PLANS else plan
    if not isinstance(plan, Plan):
        raise ValueError(f"plan must be a Plan or one of {sorted(PLANS)}; got {plan!r}")
    route = ("topk_ids", "topk_weights", ALIGN)
    # the caller produced the inputs, and the alignments both LoRA deltas reuse, on the main stream
    s = [_launch(MAIN, "inputs", writes=INPUTS + (ALIGN,))]
    if plan.lora_w13:
        s += [Step("record", MAIN, "x_ready"), Step("wait", AUX, "x_ready"),
              _launch(AUX, "zero_delta1", writes=("delta1",)),
              _launch(AUX, "lora_w13", reads=("hidden",) + route, writes=("delta1",)),
              Step("record", AUX, "delta13_done")]
    s.append(_launch(MAIN, "base_w13", reads=("hidden",) + route, writes=("cache1",)))
    if plan.lora_w13:
        s += [Step("wait", MAIN, "delta13_done"),
              _launch(MAIN, "add_w13", reads=("cache1", "delta1"), writes=("cache1",))]
    s.append(_launch(MAIN, "activation", reads=("cache1",), writes=("cache2",)))
    if plan.lora_w2:
        s += [Step("record", MAIN, "cache2_ready"), Step("wait", AUX, "cache2_ready"),
              _launch(AUX, "zero_delta2", writes=("delta2",)),
              _launch(AUX, "lora_w2", reads=("cache2",) + route, writes=("delta2",)),
              Step("record", AUX, "delta2_done")]
    s.append(_launch(MAIN, "base_w2", reads=("cache2",) + route, writes=("cache3",)))
    if plan.lora_w2:
        s += [Step("wait", MAIN, "delta2_done"),
              _launch(MAIN, "add_w2", reads=("cache3", "delta2"), writes=("cache3",))]
    s.append(_launch(MAIN, "moe_sum", reads=("cache3",) + route, writes=("out",)))
    return tuple(s)


PHASES: dict[str, Callable | None] = {
    "inputs": None,
    "zero_delta1": lambda ph, b: b["delta1"].zero_(),
    "lora_w13": lambda ph, b: ph.lora_w13(b["hidden"], b["delta1"]),
    "base_w13": lambda ph, b: ph.base_w13(b["hidden"], b["cache1"]),
    "add_w13": lambda ph, b: ph.add_w13_delta(b["cache1"], b["delta1"]),
    "activation": lambda ph, b: ph.activation(b["cache1"], b["cache2"]),
    "zero_delta2": lambda ph, b: b["delta2"].zero_(),
    "lora_w2": lambda ph, b: ph.lora_w2(b["cache2"], b["delta2"]),
    "base_w2": lambda ph, b: ph.base_w2(b["cache2"], b["cache3"]),
    "add_w2": lambda ph, b: ph.add_w2_delta(b["cache3"], b["delta2"]),
    "moe_sum": lambda ph, b: ph.moe_sum(b["cache3"], b["out"]),
}


def _ref(name: str, buffers: dict):
    return named(name, buffers[name]) if name in buffers else name


def run_program(sched: Schedule, program, phases: ExpertPhases, buffers: dict) -> None:
    """Issue `program` on `sched`: streams/events by name, each launch with its declared buffers."""
    if not isinstance(sched, Schedule):
        raise TypeError(f"sched must be a kernels.schedule.Schedule; got {type(sched).__name__}")
    if not isinstance(buffers, dict):
        raise TypeError(f"buffers must be a dict name -> tensor with keys {BUFFERS}; got {type(buffers).__name__}")
    missing = [n for n in BUFFERS if not isinstance(buffers.get(n), torch.Tensor)]
    if missing:
        raise ValueError(f"buffers is missing tensor(s) {missing}; it needs {BUFFERS}")
    for step in program:
        if step.stream != MAIN:
            sched.stream(step.stream)
        if step.kind == "record":
            sched.record(sched.event(step.name), step.stream)
        elif step.kind == "wait":
            sched.wait(sched.event(step.name), step.stream)
        elif step.kind == "launch":
            if step.name not in PHASES:
                raise ValueError(f"unknown phase {step.name!r}; known: {sorted(PHASES)}")
            body = PHASES[step.name]
            fn = None if body is None else (lambda body=body: body(phases, buffers))
            sched.launch(step.name, step.stream, fn, reads=[_ref(n, buffers) for n in step.reads],
                         writes=[_ref(n, buffers) for n in step.writes])
        else:
            raise ValueError(f"unknown step kind {step.kind!r} in {step}")
