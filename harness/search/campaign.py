"""Fuzz campaigns: find every distinct failure of one backend within a budget, each shrunk to a minimal case.

A campaign runs hypothesis searches one after another. Each failing example is shrunk (hypothesis), run
again (a changed outcome is a nondeterministic backend) and given a `Signature` (harness.search.signatures). A
failure that matches a known signature is no longer hunted, so the next search moves on. Failures found
before are replayed first from a corpus (regressions). A crash, hang, input write or nondeterministic
outcome is one more distinct failure; the campaign goes on. harness.search.fuzz_report writes what it found.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
import time
from dataclasses import dataclass, field

from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.contract import BackendSpec
from moe_lora_harness.harness.search.fuzz_report import FailureRecord
from moe_lora_harness.harness.execution.runner import WRONG_VALUE_KINDS, Outcome, run_case
from moe_lora_harness.harness.search.signatures import Signature, axes_of, every_axis, failure_class, needed_axes


@dataclass
class Found:
    """One distinct failure of the campaign."""

    signature: Signature
    outcome: Outcome
    seconds: float                 # since the campaign started
    regression: bool = False       # replayed from the corpus
    shrunk: bool = True            # False: the budget ended during its shrink, or a crash/hang's shrink was cut

    def record(self) -> FailureRecord:
        o = self.outcome
        return FailureRecord(self.signature, o.case, o.kind, o.status, round(self.seconds, 1), self.regression,
                             self.shrunk, o.repro, o.detail)


# ----------------------------------------------------------------------------- the campaign


class _Stop(BaseException):
    """The budget is spent: leaves hypothesis at once (a BaseException is not shrunk)."""


class _Enough(BaseException):
    """A crash or hang has been shrunk for long enough (each step costs a worker or a timeout): keep it."""


_SLOW_KINDS = ("crash", "timeout")
MAX_SLOW_SHRINK_STEPS = 12


class _New(AssertionError):
    """A failure of a signature not yet found: hypothesis shrinks it."""


@dataclass
class CampaignResult:
    found: list = field(default_factory=list)
    examples: int = 0
    seconds: float = 0.0
    exhausted: str = ""            # why it stopped: budget, examples, no new failure, nothing claimed
    fixed: list = field(default_factory=list)     # corpus cases that pass now
    claimed_any: bool = False


class Campaign:
    """A budgeted search of one backend at one level; see the module doc."""

    def __init__(self, spec: BackendSpec, device: str, level: str, executor, *, budget_s: float | None = None,
                 max_examples: int = 300, seed: int | None = None, reruns: int = 2, database=None,
                 corpus_dir: str | None = None, sizes: dict | None = None, progress: bool = False,
                 max_found: int = 50, shrink: bool = True):
        self.spec, self.device, self.level, self.executor = spec, device, level, executor
        self.budget_s, self.max_examples, self.seed, self.reruns = budget_s, max_examples, seed, reruns
        self.database, self.corpus_dir, self.sizes = database, corpus_dir, sizes or {}
        self.progress, self.max_found, self.shrink = progress, max_found, shrink
        self.result = CampaignResult()
        self._t0 = 0.0
        self._last_progress = 0.0

    # -- helpers ------------------------------------------------------------------------------------------
    def _left(self) -> float:
        return float("inf") if self.budget_s is None else self.budget_s - (time.monotonic() - self._t0)

    def _known_slow(self, case: Case) -> bool:
        """The case has the axes of a crash or hang already found: not run again (each costs a worker restart
        or a timeout), so the budget goes to new ground."""
        axes = None
        for f in self.result.found:
            if f.signature.klass == "hang" or f.signature.klass.startswith("crash"):
                axes = axes or axes_of(case)
                if all(axes.get(k) == v for k, v in f.signature.needs):
                    return True
        return False

    def _known(self, o: Outcome) -> bool:
        klass, axes = failure_class(o), axes_of(o.case)
        return any(f.signature.matches(klass, axes, o.semantics or None) for f in self.result.found)

    def _show(self, force: bool = False) -> None:
        if not self.progress:
            return
        now = time.monotonic()
        if not force and now - self._last_progress < 0.5:
            return
        self._last_progress = now
        el = now - self._t0
        left = self._left()
        rate = self.result.examples / el if el > 0 else 0.0
        tail = f" | {left:.0f}s left" if left != float("inf") else ""
        sys.stderr.write(f"\r[fuzz {self.spec.name}] {self.result.examples} examples ({rate:.1f}/s) | "
                         f"{len(self.result.found)} distinct failure(s){tail}   ")
        sys.stderr.flush()

    def _keep(self, sig: Signature, o: Outcome, **kw) -> Found:
        f = Found(sig, o, time.monotonic() - self._t0, **kw)
        self.result.found.append(f)
        return f

    def _add(self, o: Outcome, **kw) -> Found:
        if not self.shrink:       # detection only (selftest): the class, no shrink, no axis experiments; wrong
            if o.kind in WRONG_VALUE_KINDS:   # values are run once more, diagnosed: the name
                again = run_case(self.spec, o.case, self.device, executor=self.executor, reruns=0)
                o = again if again.failed else o
            return self._keep(Signature(failure_class(o), semantics=o.semantics), o, **dict(kw, shrunk=False))
        if self._left() > 0 and o.kind != "timeout":
            # the search runs each example once, undiagnosed (shrinking stays cheap); the minimal case is run
            # again here, diagnosed, and `reruns` more times, so a nondeterministic backend is reported as such
            again = run_case(self.spec, o.case, self.device, executor=self.executor, reruns=self.reruns)
            if again.failed:
                o = again
            else:
                first = o.kind
                o.kind, o.message = "nondeterministic", f"failed once ({first}), then {again.status} when run again"
                o.detail = (f"NONDETERMINISTIC backend={self.spec.name}: the case failed (kind={first}), then "
                            f"{again.status}ed when run again; the first run:\n{o.detail}")
        if o.kind in ("nondeterministic", "environment"):   # a property of the backend or of the run: no axes
            return self._keep(Signature(failure_class(o)), o, **kw)
        needs = needed_axes(self.spec, o, self.device, self.executor) if self._left() > 0 else every_axis(o.case)
        f = self._keep(Signature(failure_class(o), needs, o.semantics), o, **kw)
        if self.progress:
            sys.stderr.write(f"\n[fuzz] distinct failure {len(self.result.found)}: {f.signature.text}\n")
        if self.corpus_dir:
            p = pathlib.Path(self.corpus_dir)
            p.mkdir(parents=True, exist_ok=True)
            (p / f"{f.signature.key}.json").write_text(json.dumps(
                {"case": json.loads(o.case.to_json()), "signature": f.signature.text}, sort_keys=True, indent=1))
        return f

    # -- phases -----------------------------------------------------------------------------------------
    def _replay_corpus(self) -> None:
        if not self.corpus_dir or not os.path.isdir(self.corpus_dir):
            return
        for path in sorted(pathlib.Path(self.corpus_dir).glob("*.json")):
            if self._left() <= 0:
                return
            try:
                case = Case.from_json(json.loads(path.read_text())["case"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if case.problems():
                continue
            o = run_case(self.spec, case, self.device, executor=self.executor, reruns=self.reruns)
            self.result.examples += 1
            if o.failed and not self._known(o):
                self._add(o, regression=True)
            elif not o.failed and o.judged:
                self.result.fixed.append(case)
                path.unlink()       # fixed: it no longer belongs in the corpus of failures

    def run(self, strategy) -> CampaignResult:
        """Replay the corpus, then search rounds until the budget, the examples or new failures run out."""
        from hypothesis import HealthCheck, Phase, Verbosity, given, settings
        from hypothesis import seed as hseed
        from hypothesis import strategies as st
        from hypothesis.errors import Flaky, Unsatisfiable
        self._t0 = time.monotonic()
        self._replay_corpus()
        current: dict = {}
        round_no = 0
        while True:
            left_examples = self.max_examples - self.result.examples
            if left_examples <= 0:
                self.result.exhausted = "examples"
                break
            if self._left() <= 0:
                self.result.exhausted = "budget"
                break
            if len(self.result.found) >= self.max_found:
                self.result.exhausted = f"{self.max_found} distinct failures"
                break
            current.clear()

            @settings(max_examples=left_examples, deadline=None, database=self.database, derandomize=False,
                      verbosity=Verbosity.quiet, print_blob=False, suppress_health_check=list(HealthCheck),
                      phases=(Phase.reuse, Phase.generate, Phase.target) + ((Phase.shrink,) if self.shrink else ()))
            @given(st.data())
            def search(data):
                # past the budget, stop; while a found failure is being shrunk, allow a grace of a fifth of the
                # budget (at least 30 s) so it ends minimal, and stop then with the smallest so far
                grace = max(30.0, 0.2 * self.budget_s) if ("outcome" in current and self.budget_s) else 0.0
                if self._left() + grace <= 0:
                    raise _Stop
                case = data.draw(strategy, label="case")
                self.result.claimed_any = True
                if self._known_slow(case):
                    return
                o = run_case(self.spec, case, self.device, executor=self.executor, reruns=0, diagnose=False)
                self.result.examples += 1
                self._show()
                if o.failed and not self._known(o):
                    current["outcome"] = o          # the last one raised is hypothesis' minimal example
                    if o.kind in _SLOW_KINDS:
                        current["slow_steps"] = current.get("slow_steps", 0) + 1
                        if current["slow_steps"] > MAX_SLOW_SHRINK_STEPS:
                            raise _Enough
                    raise _New(o.detail)

            if self.seed is not None:
                search = hseed(self.seed + round_no)(search)
            round_no += 1
            try:
                search()
            except _New:
                self._add(current["outcome"])
                continue
            except _Enough:
                self._add(current["outcome"], shrunk=False)
                continue
            except _Stop:
                if "outcome" in current:      # the budget ended during a shrink: keep the smallest so far
                    self._add(current["outcome"], shrunk=False)
                self.result.exhausted = "budget"
                break
            except Flaky:
                o = current.get("outcome")
                if o is not None and self._left() <= 0:
                    # the budget stopped hypothesis' final replay: keep the smallest failure so far
                    self._add(o, shrunk=False)
                    self.result.exhausted = "budget"
                    break
                if o is not None:
                    o.kind = "nondeterministic"
                    o.message = "failed during the search and passed when hypothesis replayed it"
                    self._add(o)
                continue
            except Unsatisfiable:
                self.result.exhausted = "nothing claimed"
                break
            self.result.exhausted = ("examples" if self.result.examples >= self.max_examples
                                     else "the search space is exhausted")
            break
        self.result.seconds = time.monotonic() - self._t0
        self._show(force=True)
        if self.progress:
            sys.stderr.write("\n")
        return self.result
