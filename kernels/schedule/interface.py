"""The schedule interface: the only way a multi-stream executor issues device work.

An executor names its streams and events, then issues `launch` / `record` / `wait` / `host_sync`. Each
launch declares the buffers it reads and writes, so one program can run on real CUDA streams
(`kernels.schedule.cuda.CudaSchedule`) or be checked for races on the CPU
(`kernels.schedule.recorder.Recorder`) without changing a line.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

MAIN = "main"   # the stream current when the executor runs (the caller's stream)


@dataclass(frozen=True)
class BufferRef:
    """A region of memory an operation touches: `key` identifies the allocation, [start, end) its bytes.

    Tensors are keyed by (device, storage pointer) with the byte span their view covers (conservative
    for strided views: the span from the first to the last element); names are abstract resources
    covering one unit, so two refs to the same name always overlap.
    """

    name: str
    key: tuple
    start: int
    end: int

    def overlaps(self, other: "BufferRef") -> bool:
        """True if both refs lie in the same allocation and their byte ranges intersect."""
        return self.key == other.key and self.start < other.end and other.start < self.end

    @property
    def empty(self) -> bool:
        """An empty view touches no memory and can never conflict."""
        return self.end <= self.start


def tensor_span(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [start, end) of the storage a tensor view can touch (empty when it has no elements)."""
    item = t.element_size()
    start = t.storage_offset() * item
    if t.numel() == 0:
        return start, start
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return start, start + (last + 1) * item


def named(name: str, tensor: torch.Tensor) -> BufferRef:
    """A tensor's region labelled `name` (the label appears in race reports)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"named({name!r}, tensor): tensor must be a torch.Tensor; got {type(tensor).__name__}")
    start, end = tensor_span(tensor)
    dev = tensor.device
    key = ("storage", dev.type, dev.index, tensor.untyped_storage().data_ptr())
    return BufferRef(name, key, start, end)


def buffer_ref(buf: Any) -> BufferRef:
    """Normalise a buffer given as a BufferRef, a (name, tensor) pair, a tensor or a resource name."""
    if isinstance(buf, BufferRef):
        return buf
    if isinstance(buf, str):
        if not buf:
            raise ValueError("a buffer name must be a non-empty str")
        return BufferRef(buf, ("name", buf), 0, 1)
    if isinstance(buf, torch.Tensor):
        start, end = tensor_span(buf)
        return named(f"tensor@{buf.untyped_storage().data_ptr():#x}[{start}:{end}]", buf)
    if isinstance(buf, tuple) and len(buf) == 2 and isinstance(buf[0], str) and isinstance(buf[1], torch.Tensor):
        return named(buf[0], buf[1])
    raise TypeError(f"a buffer must be a BufferRef, a torch.Tensor, a (name, tensor) pair or a name str; "
                    f"got {type(buf).__name__}")


def buffer_refs(bufs: Iterable[Any] | None, what: str) -> tuple[BufferRef, ...]:
    """A tuple of BufferRefs from `reads=` / `writes=` (None or an iterable of buffers)."""
    if bufs is None:
        return ()
    if isinstance(bufs, (str, torch.Tensor, BufferRef)):
        raise TypeError(f"{what} must be a list of buffers, not a single {type(bufs).__name__}")
    return tuple(buffer_ref(b) for b in bufs)


class ScheduleError(RuntimeError):
    """A schedule misuse (unknown stream or event) or, from Recorder.assert_clean, the problems it found."""


class Schedule(ABC):
    """Streams and events by name, plus the four operations an executor may issue.

    `MAIN` always exists and means the caller's current stream. Other streams and events are created
    on first `stream(name)` / `event(name)` and reused afterwards; `created_streams` /
    `created_events` count real creations so a caller can check they happen once per layer.
    """

    def __init__(self) -> None:
        self._streams: dict[str, Any] = {MAIN: None}
        self._events: dict[str, Any] = {}
        self.created_streams = 0
        self.created_events = 0

    # -- creation -------------------------------------------------------------------------------
    def stream(self, name: str) -> str:
        """Create (once) and return the stream called `name`; MAIN is the caller's current stream."""
        _check_name(name, "stream name")
        if name not in self._streams:
            self._streams[name] = self._new_stream(name)
            self.created_streams += 1
        return name

    def event(self, name: str) -> str:
        """Create (once) and return the event called `name`."""
        _check_name(name, "event name")
        if name not in self._events:
            self._events[name] = self._new_event(name)
            self.created_events += 1
        return name

    @property
    def stream_names(self) -> tuple[str, ...]:
        """Names of the streams known so far (MAIN first, then in creation order)."""
        return tuple(self._streams)

    @property
    def event_names(self) -> tuple[str, ...]:
        """Names of the events created so far, in creation order."""
        return tuple(self._events)

    def _known_stream(self, name: str) -> str:
        if name not in self._streams:
            raise ScheduleError(f"unknown stream {name!r}: create it with schedule.stream({name!r}) first "
                                f"(known: {sorted(self._streams)})")
        return name

    def _known_event(self, name: str) -> str:
        if name not in self._events:
            raise ScheduleError(f"unknown event {name!r}: create it with schedule.event({name!r}) first "
                                f"(known: {sorted(self._events)})")
        return name

    # -- hooks for implementations ------------------------------------------------------------------
    def _new_stream(self, name: str) -> Any:
        return name

    def _new_event(self, name: str) -> Any:
        return name

    # -- the four operations ------------------------------------------------------------------------
    @abstractmethod
    def launch(self, name: str, stream: str, fn: Callable[[], Any] | None, reads=(), writes=()) -> Any:
        """Run `fn` (device work) on `stream`; `reads`/`writes` declare the buffers it touches.

        `fn=None` issues nothing and only declares accesses (e.g. the caller's inputs being ready).
        Returns fn's result.
        """

    @abstractmethod
    def record(self, event: str, stream: str) -> None:
        """Record `event` on `stream`: it completes when all work issued to `stream` so far completes."""

    @abstractmethod
    def wait(self, event: str, stream: str) -> None:
        """Make `stream` wait for the latest record of `event` issued so far (CUDA semantics)."""

    @abstractmethod
    def host_sync(self) -> None:
        """Block the host until all work on every stream has completed."""


def _check_name(name: Any, what: str) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"{what} must be a non-empty str; got {name!r}")
