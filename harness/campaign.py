"""Fuzz campaigns: find every distinct failure of one backend within a budget, each shrunk to a minimal case.

A campaign runs hypothesis searches one after another. Each failing example is shrunk (hypothesis) and
given a `Signature`: its failure class (raised type and message head, crash, hang, non-finite, untouched
element changed, per-element or aggregate bound, input written, nondeterministic, ...) and the case axes the
shrunk case needs (found by setting each unusual axis back to its plain value and re-running: which, layout,
dtype, fully_sharded, offset, add_inputs, rank class, K/N alignment, ...). A failure that matches a known
signature (same class, same values on its needed axes) is no longer hunted, so the next search moves on.
Failures found before are replayed first from a corpus (regressions). A crash, hang, input write or
nondeterministic outcome is one more distinct failure; the campaign goes on.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import sys
import time
from dataclasses import dataclass, field

from moe_lora_harness.harness.case import Case
from moe_lora_harness.harness.contract import BackendSpec
from moe_lora_harness.harness.runner import Outcome, run_case


# ----------------------------------------------------------------------------- axes and signatures


def _bucket(n: int, edges) -> str:
    """The bucket of n among `edges` (upper bounds, inclusive), as text."""
    lo = 0
    for e in edges:
        if n <= e:
            return f"{lo}-{e}" if lo != e else str(e)
        lo = e + 1
    return f">{edges[-1]}"


def _align(n: int) -> str:
    return "64k" if n % 64 == 0 else "8k" if n % 8 == 0 else "odd"


def axes_of(case: Case, spec: BackendSpec | None = None, device: str = "cpu") -> dict:
    """The axes a failure's signature is made of (values as short strings)."""
    a = {"level": case.level, "dtype": case.dtype, "tokens": _bucket(case.T, (0, 16, 64, 128)),
         "top_k": _bucket(case.top_k, (1, 4)), "rank": _bucket(case.max_rank, (1, 16, 64)),
         "padded_ranks": str(bool(case.ranks)), "mapping": case.mapping, "routing": case.routing,
         "shared": f"{case.shared_a}/{case.shared_b}",
         "ep": "dispatch" if case.dispatched else "map" if case.ep_size > 1 else "none"}
    if spec is not None:
        try:
            a["path"] = spec.precision_for(case, device)
        except Exception:  # noqa: BLE001 - a declaration that raises is its own failure, not an axis
            a["path"] = "?"
    if case.level == "op":
        a.update(which=case.which, layout=case.layout, slices=str(case.num_slices),
                 offset="0" if case.offset == 0 else "nonzero", add_inputs=str(case.add_inputs),
                 fully_sharded=str(case.fully_sharded), mul_routed_weight=str(case.mul_routed_weight),
                 K=_align(case.K), N=_align(case.N), block=str(case.block_size_m), active_loras=case.active_loras)
    else:
        from moe_lora_harness.reference.activations import is_gated
        a.update(activation=case.activation, gated=str(is_gated(case.activation)), lora=str(case.lora),
                 bias=str(case.bias), quant=case.quant, tp=str(case.tp_size), fully_sharded=str(case.fully_sharded),
                 router_weight_on_input=str(case.apply_router_weight_on_input), H=_align(case.H), I=_align(case.I))
    return a


def failure_class(o: Outcome) -> str:
    """The failure's class: its kind, with the exception type and message head for a raise, the signal for a crash."""
    kind = o.kind or o.status
    if kind in ("raised", "declaration", "environment"):
        head = re.sub(r"\d+", "#", (o.message or "").split("\n", 1)[0])[:80]
        return f"{kind}: {head}"
    if kind == "crash":
        m = re.search(r"killed by (\w+)|exited with code (\d+)", o.detail or "")
        return f"crash: {m.group(0)}" if m else "crash"
    return {"timeout": "hang", "element": "per-element bound", "aggregate": "aggregate bound",
            "nonfinite": "non-finite output", "untouched": "untouched element changed"}.get(kind, kind)


@dataclass(frozen=True)
class Signature:
    """A distinct failure: its class and the axis values the minimal case needs."""

    klass: str
    needs: tuple = ()          # ((axis, value), ...), sorted

    def matches(self, klass: str, axes: dict) -> bool:
        return klass == self.klass and all(axes.get(k) == v for k, v in self.needs)

    @property
    def text(self) -> str:
        return self.klass + (" | needs " + ", ".join(f"{k}={v}" for k, v in self.needs) if self.needs else "")

    @property
    def key(self) -> str:
        return hashlib.sha1(self.text.encode()).hexdigest()[:10]


def _flip_ep(c: Case) -> Case:
    return c.replace(ep_size=1, ep_rank=0, ep_tokens=(), ep_comm="simulated", E=max(c.top_k, c.E // c.ep_size),
                     fully_sharded=c.fully_sharded and not c.dispatched)


# axis -> the same case with that axis at its plain value (Case's defaults); used to find what a failure needs
FLIPS = {
    "dtype": lambda c: c.replace(dtype="float16"),
    "tokens": lambda c: c if c.dispatched else c.replace(T=4),
    "top_k": lambda c: c.replace(top_k=2, E=max(c.E, 2 * c.ep_size), apply_router_weight_on_input=False),
    "rank": lambda c: c.replace(max_rank=8, ranks=tuple(min(r, 8) for r in c.ranks)),
    "padded_ranks": lambda c: c.replace(ranks=()),
    "mapping": lambda c: c.replace(mapping="uniform"),
    "routing": lambda c: c.replace(routing="uniform"),
    "shared": lambda c: c.replace(shared_a=False, shared_b=False),
    "ep": _flip_ep,
    # w2 -> w13 keeps the routing-weight multiply (its own axis): a bug of mul_routed_weight found first on w2
    # and first on w13 gets one signature, not "needs which=w2" and "needs mul_routed_weight=True"
    "which": lambda c: c.replace(which="w13", num_slices=2, offset=0),
    "layout": lambda c: c.replace(layout="sorted", active_loras="all"),
    "slices": lambda c: c.replace(num_slices=2) if c.which == "w13" else c,
    "offset": lambda c: c.replace(offset=0),
    "add_inputs": lambda c: c.replace(add_inputs=True),
    "fully_sharded": lambda c: c.replace(fully_sharded=False),
    "mul_routed_weight": lambda c: (c.replace(which="w13", num_slices=2, mul_routed_weight=False, offset=0)
                                    if c.which == "w2" else c.replace(mul_routed_weight=False)),   # w2 multiplies
    "K": lambda c: c.replace(H=64) if c.which == "w13" or c.level == "expert" else c.replace(I=32),
    "N": lambda c: c.replace(I=32) if c.which == "w13" else c.replace(H=64),
    "H": lambda c: c.replace(H=64),
    "I": lambda c: c.replace(I=32),
    "block": lambda c: c.replace(block_size_m=16),
    "active_loras": lambda c: c.replace(active_loras="all"),
    "activation": lambda c: c.replace(activation="silu", bias=False),
    "gated": lambda c: c.replace(activation="silu"),
    "lora": lambda c: c.replace(lora=True),
    "bias": lambda c: c.replace(bias=False),
    "quant": lambda c: c.replace(quant="none"),
    "tp": lambda c: c.replace(tp_size=1, tp_rank=0, fully_sharded=False),
    "router_weight_on_input": lambda c: c.replace(apply_router_weight_on_input=False),
}
PLAIN = axes_of(Case())            # op level; an expert case is compared with the expert-level plain case
PLAIN_EXPERT = axes_of(Case(level="expert"))


def needed_axes(spec: BackendSpec, o: Outcome, device: str, executor, reruns: int = 0) -> tuple:
    """The axes the failing case needs: each axis off its plain value is set back to it (FLIPS); if the case
    then passes (or fails another way) the failure needs that axis. An axis that cannot be flipped (the
    flipped case is malformed or not claimed) counts as needed."""
    from moe_lora_harness.harness.contract import support_for
    case, klass = o.case, failure_class(o)
    axes = axes_of(case, spec, device)
    plain = PLAIN_EXPERT if case.level == "expert" else PLAIN
    needs = []
    for axis, value in sorted(axes.items()):
        if axis in ("level", "path") or plain.get(axis) == value:
            continue
        flip = FLIPS.get(axis)
        try:
            flipped = flip(case) if flip else None
        except (TypeError, ValueError):
            flipped = None
        if flipped == case:          # implied by another axis (w2 has one slice and multiplies the weight)
            continue
        if flipped is None or flipped.problems() or not support_for(spec, flipped, device)[0]:
            needs.append((axis, value))
            continue
        again = run_case(spec, flipped, device, executor=executor, reruns=reruns, diagnose=False)
        if not (again.failed and failure_class(again) == klass):
            needs.append((axis, value))
    if ("which", "w2") in needs:     # every w2 case multiplies: the pair would match exactly what w2 alone does
        needs = [n for n in needs if n != ("mul_routed_weight", "True")]
    return tuple(needs)


@dataclass
class Found:
    """One distinct failure of the campaign."""

    signature: Signature
    outcome: Outcome
    seconds: float                 # since the campaign started
    regression: bool = False       # replayed from the corpus
    shrunk: bool = True            # False: the budget ended during its shrink, or a crash/hang's shrink was cut

    def record(self, device: str) -> dict:
        o = self.outcome
        return {"signature": self.signature.text, "class": self.signature.klass, "needs": dict(self.signature.needs),
                "case": json.loads(o.case.to_json()), "kind": o.kind, "status": o.status, "seconds": round(self.seconds, 1),
                "regression": self.regression, "shrunk": self.shrunk,
                "repro": repro_command_for(o, device), "detail": o.detail}


def repro_command_for(o: Outcome, device: str) -> str:
    line = next((ln for ln in (o.detail or "").splitlines() if ln.startswith("REPRO: ")), "")
    return line.removeprefix("REPRO: ")


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
                axes = axes or axes_of(case, self.spec, self.device)
                if all(axes.get(k) == v for k, v in f.signature.needs):
                    return True
        return False

    def _known(self, o: Outcome) -> bool:
        klass, axes = failure_class(o), axes_of(o.case, self.spec, self.device)
        return any(f.signature.matches(klass, axes) for f in self.result.found)

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

    def _add(self, o: Outcome, **kw) -> Found:
        if not self.shrink:       # detection only (selftest): the class, no shrink, no axis experiments
            kw["shrunk"] = False
            f = Found(Signature(failure_class(o)), o, time.monotonic() - self._t0, **kw)
            self.result.found.append(f)
            return f
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
            f = Found(Signature(failure_class(o)), o, time.monotonic() - self._t0, **kw)
            self.result.found.append(f)
            return f
        needs = needed_axes(self.spec, o, self.device, self.executor) if self._left() > 0 else tuple(
            sorted((k, v) for k, v in axes_of(o.case, self.spec, self.device).items() if k != "path"))
        f = Found(Signature(failure_class(o), needs), o, time.monotonic() - self._t0, **kw)
        self.result.found.append(f)
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


# ----------------------------------------------------------------------------- the report (one campaign or merged jobs)


def records_table(records: list) -> str:
    """The distinct failures (`Found.record` dicts) as a text table, each with its minimal case and REPRO
    line; the records of merged jobs (harness.fuzz_jobs) name their job."""
    if not records:
        return ""
    lines = [f"{len(records)} distinct failure(s):", ""]
    for i, (r, fits) in enumerate(zip(records, also_fits(records)), 1):
        tags = ((" [regression]" if r.get("regression") else "") + ("" if r.get("shrunk", True) else " [partly shrunk]")
                + (" [environment, not a kernel bug]" if r.get("kind") == "environment" else ""))
        job = f" (job {r['job']})" if "job" in r else ""
        lines.append(f"#{i} at {r['seconds']:.0f}s{job}{tags}: {r['signature']}")
        lines.append(f"   CASE: {Case.from_json(r['case']).to_json()}")
        lines.append(f"   REPRO: {r['repro']}")
        if fits:
            lines.append(f"   ALSO FITS the signature of #{', #'.join(map(str, fits))}: perhaps one bug met in two forms")
    return "\n".join(lines)


def record_signature(record: dict) -> Signature:
    """The Signature a `Found.record` dict was written from."""
    return Signature(record["class"], tuple(sorted(record["needs"].items())))


def record_matches(record: dict, sig: Signature) -> bool:
    """Whether a record's failure (its class, the axes of its minimal case) matches `sig`."""
    return sig.matches(record["class"], axes_of(Case.from_json(record["case"])))


def also_fits(records: list) -> list:
    """For each record, the numbers (1-based) of the other records whose signature its minimal case matches.

    Signatures are found in order, so a bug first met in a narrow form and later in a wider one can be two
    records; they may also be two bugs (a case can fail for both), so both are kept and the overlap is said.
    """
    sigs = [record_signature(r) for r in records]
    return [[j + 1 for j, sig in enumerate(sigs) if j != i and record_matches(r, sig)] for i, r in enumerate(records)]


def write_reports(records: list, summary: dict, out: str | None, junit: str | None, *, name: str, level: str,
                  seconds: float, claimed: bool, label: str = "") -> None:
    """failure-NN.json and campaign.json (`summary` plus the distinct failures) under `out`; JUnit XML at
    `junit`: one test case per distinct failure, or one for the campaign (failing when nothing was tested)."""
    if out:
        o = pathlib.Path(out)
        o.mkdir(parents=True, exist_ok=True)
        for i, (r, fits) in enumerate(zip(records, also_fits(records)), 1):
            rec = dict(r, also_fits=[records[j - 1]["signature"] for j in fits]) if fits else r
            (o / f"failure-{i:02d}.json").write_text(json.dumps(rec, indent=1, sort_keys=True))
        (o / "campaign.json").write_text(json.dumps(dict(summary, distinct_failures=[r["signature"] for r in records]),
                                                    indent=1, sort_keys=True))
    if junit:
        from moe_lora_harness.harness.report import to_junit
        cases = [dict(classname=f"fuzz.{name}", name=f"#{i} {r['signature']}", status="fail", message=r["signature"],
                      detail=r["detail"], seconds=r["seconds"]) for i, r in enumerate(records, 1)]
        if not cases:
            cases = [dict(classname=f"fuzz.{name}", name=f"{level}-level campaign{label}", seconds=seconds,
                          status="pass" if claimed else "fail", message="" if claimed else "nothing tested")]
        pathlib.Path(junit).write_text(to_junit("moe-lora-harness fuzz", cases))


def print_report(records: list, fixed: list, *, name: str, level: str, device: str, examples: int, seconds: float,
                 stopped: str, out: str | None, jobs: int = 1) -> None:
    """Each failure's detail, the corpus cases that pass now (`fixed`, as JSON), the table, the closing line."""
    for r in records:
        print(r["detail"] + "\n")
    for c in fixed:
        print(f"FIXED since the last run (removed from the corpus): {c}")
    table = records_table(records)
    if table:
        print(table)
    env = sum(r.get("kind") == "environment" for r in records)
    print(f"\n{name}: {examples} {level}-level examples in {seconds:.0f}s on {device}"
          + (f" over {jobs} jobs" if jobs > 1 else "")
          + f", {len(records) - env} distinct failure(s)" + (f" and {env} environment failure(s)" if env else "")
          + (f"; stopped: {stopped}" if stopped else "") + (f"; reports in {out}" if out else ""))
