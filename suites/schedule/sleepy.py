"""`SleepySchedule`: wraps a CudaSchedule and injects `torch.cuda._sleep` around launches to widen race
windows, for the GPU stress tests (test-only)."""
from __future__ import annotations

import random
from typing import Any, Callable

import torch

from moe_lora_harness.kernels.schedule.cuda import CudaSchedule
from moe_lora_harness.kernels.schedule.interface import MAIN, Schedule


class SleepySchedule(Schedule):
    """Wraps a CudaSchedule and spins the GPU (`torch.cuda._sleep`) before/after launches to widen races.

    `mode`: "aux" delays every launch on streams other than MAIN, "main" delays every MAIN launch,
    "random" delays each launch's stream before and/or after with probability `p` (seeded).
    A correct program must give bit-identical results under every mode.
    """

    MODES = ("aux", "main", "random")

    def __init__(self, inner: CudaSchedule, *, mode: str = "random", cycles: int = 2_000_000,
                 p: float = 0.5, seed: int = 0) -> None:
        super().__init__()
        if not isinstance(inner, CudaSchedule):
            raise TypeError(f"inner must be a CudaSchedule; got {type(inner).__name__}")
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}; got {mode!r}")
        if not isinstance(cycles, int) or cycles < 1:
            raise ValueError(f"cycles must be a positive int; got {cycles!r}")
        self.inner, self.mode, self.cycles, self.p = inner, mode, cycles, float(p)
        self._rng = random.Random(seed)
        self._streams, self._events = inner._streams, inner._events   # share names with the inner schedule

    def stream(self, name: str) -> str:
        return self.inner.stream(name)

    def event(self, name: str) -> str:
        return self.inner.event(name)

    def _sleep(self, stream: str) -> None:
        with torch.cuda.stream(self.inner.cuda_stream(stream)):
            torch.cuda._sleep(self.cycles)

    def launch(self, name: str, stream: str, fn: Callable[[], Any] | None, reads=(), writes=()) -> Any:
        if fn is None:
            return self.inner.launch(name, stream, fn, reads, writes)
        if self.mode == "random":
            before, after = self._rng.random() < self.p, self._rng.random() < self.p
        else:
            before, after = (stream != MAIN) == (self.mode == "aux"), False
        if before:
            self._sleep(stream)
        out = self.inner.launch(name, stream, fn, reads, writes)
        if after:
            self._sleep(stream)
        return out

    def record(self, event: str, stream: str) -> None:
        self.inner.record(event, stream)

    def wait(self, event: str, stream: str) -> None:
        self.inner.wait(event, stream)

    def host_sync(self) -> None:
        self.inner.host_sync()
