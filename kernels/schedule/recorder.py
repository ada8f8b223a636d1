"""`Recorder`: a CPU schedule that runs each launch at once, in issue order, and finds unordered accesses.

Happens-before is tracked with one vector clock per stream: program order within a stream, an edge
from a record to every wait that binds to it (a wait binds to the latest record issued before it, as
cudaStreamWaitEvent does), and `host_sync` joining every stream. Two accesses to overlapping bytes,
at least one a write, that are not ordered either way are a race. Event misuse is reported too:
waiting on an event never recorded (a no-op on CUDA), and signs of event reuse (a stream waiting
twice on the same record, waiting on its own stream's record, a record overwritten before anyone
waited on it, or re-recorded while a waiter of the older record is not yet ordered before it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from moe_lora_harness.kernels.schedule.interface import BufferRef, Schedule, ScheduleError, buffer_refs

Clock = dict  # stream name -> count of that stream's operations known to have happened


@dataclass(frozen=True)
class Op:
    """One issued operation: its index in issue order, kind, name, stream and own clock component."""

    index: int
    kind: str          # launch | record | wait | sync
    name: str
    stream: str
    tick: int          # value of this stream's clock component at this op

    def __str__(self) -> str:
        what = {"launch": f"'{self.name}'", "record": f"record({self.name})", "wait": f"wait({self.name})",
                "sync": "host_sync"}[self.kind]
        return f"{what} on stream {self.stream} (op #{self.index})"


@dataclass(frozen=True)
class Race:
    """Two conflicting accesses to overlapping bytes of one buffer that no happens-before edge orders."""

    buffer: str
    first: Op
    first_access: str      # read | write
    second: Op
    second_access: str
    span: tuple[int, int]

    @property
    def kind(self) -> str:
        """'write/read', 'read/write' or 'write/write', in issue order."""
        return f"{self.first_access}/{self.second_access}"

    def __str__(self) -> str:
        return (f"race on {self.buffer} bytes [{self.span[0]}, {self.span[1]}): {self.first_access} by "
                f"{self.first} and {self.second_access} by {self.second} are not ordered")


@dataclass(frozen=True)
class Hazard:
    """An event misuse: `kind` is 'wait-unrecorded' or 'event-reuse'; `message` names the operations."""

    kind: str
    event: str
    message: str

    def __str__(self) -> str:
        return f"{self.kind} ({self.event}): {self.message}"


@dataclass
class _Access:
    ref: BufferRef
    op: Op
    write: bool


@dataclass
class _EventState:
    record: Op | None = None
    clock: Clock | None = None
    waits: list = field(default_factory=list)   # [(stream, wait Op)] on the latest record


class Recorder(Schedule):
    """CPU schedule: executes launches immediately (real tensors, real values) and records happens-before.

    `races` and `hazards` accumulate over the recorder's life (several executor calls can be checked
    together, which exposes cross-call buffer reuse). `execute=False` checks a schedule without running it.
    """

    def __init__(self, *, execute: bool = True) -> None:
        super().__init__()
        self.execute = execute
        self.ops: list[Op] = []
        self._snap: list[Clock] = []     # each op's stream clock once the op took effect
        self.races: list[Race] = []
        self.hazards: list[Hazard] = []
        self._clocks: dict[str, Clock] = {}
        self._floor: Clock = {}          # what every stream knows after the last host_sync
        self._state: dict[str, _EventState] = {}
        self._history: dict[tuple, list[_Access]] = {}
        self._seen: set = set()

    # -- bookkeeping ----------------------------------------------------------------------------------
    def _new_stream(self, name: str) -> Any:
        self._clocks[name] = dict(self._floor)
        return name

    def _new_event(self, name: str) -> Any:
        self._state[name] = _EventState()
        return name

    def _clock(self, stream: str) -> Clock:
        name = self._known_stream(stream)
        if name not in self._clocks:
            self._clocks[name] = dict(self._floor)
        return self._clocks[name]

    def _issue(self, kind: str, name: str, stream: str) -> Op:
        clock = self._clock(stream)
        clock[stream] = clock.get(stream, 0) + 1
        op = Op(len(self.ops), kind, name, stream, clock[stream])
        self.ops.append(op)
        self._snap.append(dict(clock))
        return op

    def _ordered(self, earlier: Op, later_stream: str) -> bool:
        """Whether `earlier` happens-before everything `later_stream` issues from now on."""
        return self._clock(later_stream).get(earlier.stream, 0) >= earlier.tick

    def _freeze(self, op: Op) -> None:
        """Re-snapshot `op`'s clock after it changed it (a wait's join is part of the wait)."""
        self._snap[op.index] = dict(self._clock(op.stream))

    def happens_before(self, first: Op, second: Op) -> bool:
        """Whether stream op `first` is ordered before op `second` (issue order, program order, events, syncs)."""
        if first.kind == "sync" or first.index >= second.index:
            return False
        return self._snap[second.index].get(first.stream, 0) >= first.tick

    def _hazard(self, kind: str, event: str, message: str) -> None:
        self.hazards.append(Hazard(kind, event, message))

    # -- operations -------------------------------------------------------------------------------------
    def launch(self, name: str, stream: str, fn: Callable[[], Any] | None, reads=(), writes=()) -> Any:
        if not isinstance(name, str) or not name:
            raise TypeError(f"launch name must be a non-empty str; got {name!r}")
        if fn is not None and not callable(fn):
            raise TypeError(f"launch {name!r}: fn must be callable or None; got {type(fn).__name__}")
        r = buffer_refs(reads, f"launch {name!r} reads")
        w = buffer_refs(writes, f"launch {name!r} writes")
        op = self._issue("launch", name, stream)
        accesses = [_Access(ref, op, False) for ref in r] + [_Access(ref, op, True) for ref in w]
        for acc in accesses:
            if not acc.ref.empty:
                self._check(acc)
        for acc in accesses:
            if not acc.ref.empty:
                self._history.setdefault(acc.ref.key, []).append(acc)
        return fn() if (fn is not None and self.execute) else None

    def _check(self, acc: _Access) -> None:
        for prev in self._history.get(acc.ref.key, ()):
            if prev.op.index == acc.op.index or not (prev.write or acc.write) or not prev.ref.overlaps(acc.ref):
                continue
            if self._ordered(prev.op, acc.op.stream):
                continue
            key = (prev.op.index, acc.op.index, acc.ref.name)
            if key in self._seen:
                continue
            self._seen.add(key)
            lo, hi = max(prev.ref.start, acc.ref.start), min(prev.ref.end, acc.ref.end)
            self.races.append(Race(acc.ref.name, prev.op, "write" if prev.write else "read", acc.op,
                                   "write" if acc.write else "read", (lo, hi)))

    def record(self, event: str, stream: str) -> None:
        st = self._state[self._known_event(event)]
        op = self._issue("record", event, stream)
        if st.record is not None:
            if not st.waits:
                self._hazard("event-reuse", event,
                             f"{op} overwrites the record {st.record}, which no stream waited on: that signal is lost")
            for wstream, wop in st.waits:
                if not self._ordered(wop, stream):
                    self._hazard("event-reuse", event,
                                 f"{op} re-records the event while {wop}, a wait on its older record "
                                 f"{st.record}, is not ordered before it: that waiter still depends on the "
                                 f"older record (a wait meant for this one would bind to the old one)")
        st.record, st.clock, st.waits = op, dict(self._clock(stream)), []

    def wait(self, event: str, stream: str) -> None:
        st = self._state[self._known_event(event)]
        op = self._issue("wait", event, stream)
        if st.record is None:
            self._hazard("wait-unrecorded", event,
                         f"{op} waits on an event that was never recorded: on CUDA this wait is a no-op")
            return
        if st.record.stream == stream:
            self._hazard("event-reuse", event,
                         f"{op} waits on {st.record}, recorded on the same stream: the wait orders nothing "
                         f"(was an event meant for another stream reused?)")
        for wstream, wop in st.waits:
            if wstream == stream:
                self._hazard("event-reuse", event,
                             f"{op} waits again on {st.record}, which this stream already waited on at {wop}: "
                             f"a wait binds to the latest record issued, so a wait meant for a later record "
                             f"of a reused event binds to this old one")
                break
        st.waits.append((stream, op))
        clock = self._clock(stream)
        for s, t in st.clock.items():
            if clock.get(s, 0) < t:
                clock[s] = t
        self._freeze(op)

    def host_sync(self) -> None:
        joined: Clock = dict(self._floor)
        for clock in self._clocks.values():
            for s, t in clock.items():
                joined[s] = max(joined.get(s, 0), t)
        self.ops.append(Op(len(self.ops), "sync", "host_sync", "host", 0))
        self._snap.append(dict(joined))
        self._floor = joined
        for name in self._streams:
            self._clocks[name] = dict(joined)
        self._history.clear()   # every access so far is ordered before anything issued from now on

    # -- results ------------------------------------------------------------------------------------------
    @property
    def problems(self) -> list[str]:
        """Every race and hazard found so far, as readable lines."""
        return [str(r) for r in self.races] + [str(h) for h in self.hazards]

    @property
    def clean(self) -> bool:
        """True when no race and no event hazard has been found."""
        return not self.races and not self.hazards

    def assert_clean(self) -> None:
        """Raise ScheduleError listing every race and event hazard, if any was found."""
        if not self.clean:
            raise ScheduleError(f"{len(self.races)} race(s), {len(self.hazards)} event hazard(s):\n  "
                                + "\n  ".join(self.problems))

    def trace(self) -> str:
        """The issued operations, one per line (for failure messages)."""
        return "\n".join(str(op) for op in self.ops)
