"""`CudaSchedule`: the schedule on real torch.cuda streams and events (the GPU stress tests wrap it in
suites/schedule/sleepy.py's SleepySchedule, which widens race windows).

Streams and events are created once per schedule (so once per layer when a layer keeps its schedule);
MAIN is whatever stream is current when an operation is issued (the caller's stream, or a CUDA-graph
capture stream). `single_stream=True` maps every stream to MAIN: the same program, run serially.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from moe_lora_harness.kernels.schedule.interface import MAIN, Schedule


class CudaSchedule(Schedule):
    """Runs launches under `torch.cuda.stream(s)`; records and waits real events.

    `streams` / `events` adopt existing objects by name (e.g. a layer's `aux_stream` and `events`);
    anything else is created on first use and counted in `created_streams` / `created_events`.
    """

    def __init__(self, device=None, *, streams: dict | None = None, events: dict | None = None,
                 single_stream: bool = False) -> None:
        super().__init__()
        if not torch.cuda.is_available():
            raise RuntimeError("CudaSchedule needs a CUDA device; use kernels.schedule.Recorder on the CPU")
        self.device = torch.device("cuda" if device is None else device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaSchedule device must be a cuda device; got {self.device}")
        self.single_stream = bool(single_stream)
        for name, s in (streams or {}).items():
            if name == MAIN or not isinstance(s, torch.cuda.Stream):
                raise TypeError(f"streams[{name!r}] must be a torch.cuda.Stream under a name other than {MAIN!r}")
            self._streams[name] = s
        for name, e in (events or {}).items():
            if not isinstance(e, torch.cuda.Event):
                raise TypeError(f"events[{name!r}] must be a torch.cuda.Event; got {type(e).__name__}")
            self._events[name] = e

    def _new_stream(self, name: str) -> Any:
        return torch.cuda.Stream(device=self.device)

    def _new_event(self, name: str) -> Any:
        return torch.cuda.Event()

    def cuda_stream(self, name: str) -> torch.cuda.Stream:
        """The torch stream `name` stands for now (MAIN and, in single-stream mode, every name: the current one)."""
        self._known_stream(name)
        if name == MAIN or self.single_stream:
            return torch.cuda.current_stream(self.device)
        return self._streams[name]

    def cuda_event(self, name: str) -> torch.cuda.Event:
        """The torch event called `name`."""
        return self._events[self._known_event(name)]

    def launch(self, name: str, stream: str, fn: Callable[[], Any] | None, reads=(), writes=()) -> Any:
        s = self.cuda_stream(stream)
        if fn is None:
            return None
        if s == torch.cuda.current_stream(self.device):
            return fn()
        with torch.cuda.stream(s):
            return fn()

    def record(self, event: str, stream: str) -> None:
        self.cuda_event(event).record(self.cuda_stream(stream))

    def wait(self, event: str, stream: str) -> None:
        self.cuda_stream(stream).wait_event(self.cuda_event(event))

    def host_sync(self) -> None:
        torch.cuda.synchronize(self.device)
