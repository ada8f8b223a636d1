"""check's progress: on a terminal, one live line (runs done / planned, failures, the backend now, elapsed, time
left at the rate so far); and, once at the end, each backend's time, since a long run's plan (model mode) visits
a backend many times. `LiveLine` is the carriage-return line itself, shared with selftest's progress."""
from __future__ import annotations

import sys
import time
from collections import defaultdict

WIDTH = 119


def clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class LiveLine:
    """One line rewritten in place (carriage return) when `live`, at most every `every_s` seconds; `say` prints a
    whole line above it (live or not), so that plain lines and the live one do not mix."""

    def __init__(self, live: bool, stream=None, every_s: float = 0.5):
        self.live, self.stream, self.every_s = live, stream or sys.stderr, every_s
        self._shown = float("-inf")

    def show(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if not self.live or (not force and now - self._shown < self.every_s):
            return
        self._shown = now
        self.stream.write("\r" + text[:WIDTH].ljust(WIDTH))
        self.stream.flush()

    def say(self, line: str) -> None:
        self.clear()
        self.stream.write(line + "\n")
        self.stream.flush()

    def clear(self) -> None:
        if self.live:
            self.stream.write("\r" + " " * WIDTH + "\r")
            self.stream.flush()


class CheckProgress:
    """The live line (only when `live`: a terminal, neither -q nor $CI) and the time per backend; with `jobs` > 1
    (check --jobs) the line says so and names the run handed out last."""

    def __init__(self, planned: int, live: bool, stream=None, every_s: float = 0.5, jobs: int = 1):
        self.planned, self.line, self.jobs = planned, LiveLine(live, stream, every_s), jobs
        self.done = self.failed = 0
        self.per_backend = defaultdict(float)
        self._t0 = time.monotonic()

    def start(self, backend: str, feature: str) -> None:
        """A run begins: the line names it (at most every `every_s` seconds)."""
        el = time.monotonic() - self._t0
        left = f", ~{clock(el / self.done * (self.planned - self.done))} left" if self.done else ""
        jobs = f" ({self.jobs} jobs)" if self.jobs > 1 else ""
        self.line.show(f"[check] {self.done}/{self.planned} runs{jobs}, {self.failed} failed, {clock(el)}{left} | "
                       f"{backend}: {feature}")

    def finished(self, outcome, seconds: float) -> None:
        """A run ended after `seconds` (wall, judging included): counted, and the time added to its backend's (with
        jobs, the sum of the runs' times: more than the wall time)."""
        self.done += 1
        self.failed += bool(outcome.failed)
        self.per_backend[outcome.backend] += seconds

    def close(self) -> str:
        """Clear the live line; the time per backend, one line ('' when nothing ran)."""
        self.line.clear()
        if not self.per_backend:
            return ""
        return "[time per backend: " + ", ".join(f"{b} {s:.1f}s" for b, s in self.per_backend.items()) + "]"
