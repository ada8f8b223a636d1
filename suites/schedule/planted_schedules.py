"""Planted bugs: variants of kernels.experts.dual_stream's program, each with exactly one synchronisation or
zeroing bug (test-only: the schedule suites run them).

They exist so the schedule suites can prove they fail when they should: on the CPU the Recorder must
report a race (or an event hazard) for each, except `not_zeroed`, which is race-free but leaves the
workspace's non-zero poison in the pairs the LoRA does not write, so the value comparison must catch it.
On a GPU under sleep injection the racy ones must give a result that differs from the single-stream run.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from moe_lora_harness.kernels.experts.dual_stream import AUX, Step, dual_stream_program
from moe_lora_harness.kernels.schedule.interface import MAIN


def _find(program, kind: str, stream: str, name: str) -> int:
    for i, s in enumerate(program):
        if (s.kind, s.stream, s.name) == (kind, stream, name):
            return i
    raise ValueError(f"step {kind} {name} on {stream} not in the program")


def _drop(program, kind, stream, name):
    i = _find(program, kind, stream, name)
    return program[:i] + program[i + 1:]


def _move_before(program, what: tuple, anchor: tuple):
    """Move step `what` (kind, stream, name) to just before step `anchor`."""
    p = list(program)
    step = p.pop(_find(p, *what))
    p.insert(_find(p, *anchor), step)
    return tuple(p)


def missing_wait(program):
    """Main adds the w13 delta without waiting for the aux stream to produce it."""
    return _drop(program, "wait", MAIN, "delta13_done")


def record_before_kernel(program):
    """The aux stream records delta2_done before launching the w2 LoRA kernel it should follow."""
    return _move_before(program, ("record", AUX, "delta2_done"), ("launch", AUX, "lora_w2"))


def event_reused(program):
    """One "ready" event for both phases: cache2_ready is x_ready again, and since "the same event fires
    again" the aux stream's w2 chain is issued right after its w13 chain, so its wait binds to the w13
    record and the w2 LoRA reads cache2 before the activation writes it."""
    p = [replace(s, name="x_ready") if s.name == "cache2_ready" else s for s in program]
    start = _find(p, "wait", AUX, "x_ready")
    w2_wait = [i for i, s in enumerate(p) if (s.kind, s.stream, s.name) == ("wait", AUX, "x_ready")][1]
    chain = p[w2_wait:w2_wait + 4]          # wait, zero_delta2, lora_w2, record delta2_done
    del p[w2_wait:w2_wait + 4]
    after_w13 = _find(p, "record", AUX, "delta13_done") + 1
    assert start < after_w13
    return tuple(p[:after_w13] + chain + p[after_w13:])


def not_zeroed(program):
    """The delta buffers are never zeroed: pairs the LoRA skips keep whatever the workspace held."""
    return _drop(_drop(program, "launch", AUX, "zero_delta1"), "launch", AUX, "zero_delta2")


def delta_read_early(program):
    """Main adds the w2 delta before waiting for the aux stream (the wait comes one step too late)."""
    return _move_before(program, ("launch", MAIN, "add_w2"), ("wait", MAIN, "delta2_done"))


def aux_no_input_wait(program):
    """The aux stream starts the w13 LoRA without waiting for the hidden states to be ready."""
    return _drop(program, "wait", AUX, "x_ready")


PLANTED: dict[str, Callable] = {
    "missing_wait": missing_wait,
    "record_before_kernel": record_before_kernel,
    "event_reused": event_reused,
    "not_zeroed": not_zeroed,
    "delta_read_early": delta_read_early,
    "aux_no_input_wait": aux_no_input_wait,
}

# Which planted bugs are races (caught by happens-before / a GPU under stress); the rest are value bugs.
RACY = ("missing_wait", "record_before_kernel", "event_reused", "delta_read_early", "aux_no_input_wait")


def planted_program(bug: str, plan="both") -> tuple[Step, ...]:
    """The dual-stream program for `plan` with the planted `bug` (a PLANTED key)."""
    if bug not in PLANTED:
        raise ValueError(f"bug must be one of {sorted(PLANTED)}; got {bug!r}")
    return PLANTED[bug](dual_stream_program(plan))
