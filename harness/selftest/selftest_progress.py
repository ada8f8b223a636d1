"""selftest's progress: one plain line per mutant or control as it finishes (its verdict, its seconds), and on a
terminal a live line (finished / planned, kills, survivors, elapsed, the mutant and row now running)."""
from __future__ import annotations

import time

from moe_lora_harness.harness.check.check_progress import LiveLine, clock
from moe_lora_harness.harness.selftest.selftest import control_verdict, verdict


class SelftestProgress:
    """`live`: the carriage-return line too (a terminal, neither -q nor $CI); `verbose`: a line as each starts;
    `jobs` > 1 (selftest --jobs): the live line says so and names the mutant handed out last."""

    def __init__(self, live: bool, verbose: bool = False, stream=None, every_s: float = 0.5, jobs: int = 1):
        self.line, self.verbose, self.jobs = LiveLine(live, stream, every_s), verbose, jobs
        self.planned = self.done = self.killed = self.survived = self.misnamed = 0
        self._t0 = time.monotonic()

    def begin(self, planned: int) -> None:
        self.planned = planned

    def start(self, key) -> None:
        if self.verbose:
            self.line.say(f"[selftest] {'/'.join(key)}")
        self.step(key, "starting")

    def step(self, key, what: str) -> None:
        """The live line: counts so far, and what `key` is running now (a check row, the fuzz campaign)."""
        jobs = f" ({self.jobs} jobs)" if self.jobs > 1 else ""
        self.line.show(f"[selftest] {self.done}/{self.planned} done{jobs}, {self.killed} killed, "
                       f"{self.survived} survived"
                       + (f", {self.misnamed} misnamed" if self.misnamed else "")
                       + f", {clock(time.monotonic() - self._t0)} | {'/'.join(key)}: {what}")

    def finished(self, key, res, seconds: float) -> None:
        """`key` finished: its verdict from `res` (a SelftestResult), one plain line."""
        self.done += 1
        if key in res.cells:
            cells = res.cells[key]
            self.misnamed += any(k.misnamed for k in cells.values())
            caught = any(k.caught for k in cells.values())
            self.killed += caught
            self.survived += bool(cells) and not caught
            text = verdict(cells)
        else:
            text = control_verdict(res.controls[key])
        self.line.say(f"[selftest {self.done}/{self.planned}] {'/'.join(key)}: {text} [{seconds:.1f}s]")

    def close(self) -> None:
        self.line.clear()
