"""`moe-lora-harness selftest`: every planted-bug corpus of the project through the harness's own detectors.

A corpus is data: a backend reference holding mutants (each wrong in one known way) and controls (correct),
the level they run at and the check features that concern them. Each mutant is attacked by each detector:
`check` (the corpus' feature rows, one case each, until the first failure) and `fuzz` (a budgeted campaign);
the kill matrix gives, per mutant and detector, whether and after how long it was caught. A mutant whose
mechanism is a semantic alternative (reference.semantics; the corpus' `mechanisms`) must also be named as
that mistake by each detector that catches it. The run fails if a mutant survives every detector, is
caught but misnamed, or a control fails anything. A run stopped by its deadline (selftest --budget) or by Ctrl-C
keeps what finished: its result is partial and says what was not reached. `run_selftest_jobs` (selftest --jobs N)
runs the same plan in N job processes (harness.execution.job_pool) into the same result.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from moe_lora_harness.harness.search.campaign import Campaign
from moe_lora_harness.harness.check.features import DECODE_ROW, FEATURES, Feature, feature_cases
from moe_lora_harness.harness.draw.profiles import selftest_draw_sizes
from moe_lora_harness.harness.spec.registry import load_attr, load_ref
from moe_lora_harness.harness.execution.runner import run_case
from moe_lora_harness.harness.draw.strategies import claimed_cases, wants_compile_classes


@dataclass(frozen=True)
class Corpus:
    """One planted-bug corpus: `ref` loads its backends; names in `controls` are the correct ones."""

    name: str
    ref: str
    controls: tuple
    level: str
    features: Callable[[Feature], bool]
    select: Callable[[object], bool] = lambda spec: True     # which of the ref's backends belong to it
    devices: tuple = ("cpu", "cuda")
    fuzz_level: str | None = None       # claimed_cases level (default: `level`; "ep" / "tp": those ranks only)
    mechanisms: str | None = None    # ref of {backend name: semantic alternative it commits} (None: no names)
    # ref of a function backend name -> [(row label, Case)]: check's rows for that backend instead of feature rows
    # (cases no feature reaches, e.g. a catalogue model's shape)
    cases: str | None = None
    not_here: tuple = ()             # (device, why the corpus does not run there) pairs


def _is_level(level):
    return lambda spec: level in spec.capabilities.levels


CORPORA = (
    Corpus("op", "moe_lora_harness.harness.selftest.mutants:MUTANTS", ("mutant-control",), "op",
           lambda f: f.level == "op", select=_is_level("op"),
           mechanisms="moe_lora_harness.harness.selftest.mutants:MECHANISMS"),
    Corpus("tp", "moe_lora_harness.harness.selftest.mutants:MUTANTS", ("mutant-experts-control",), "expert",
           lambda f: "TP 2" in f.name, select=_is_level("expert"), fuzz_level="tp",
           mechanisms="moe_lora_harness.harness.selftest.mutants:MECHANISMS"),
    Corpus("semantics", "moe_lora_harness.suites.experts.semantic_mutants:BACKENDS", ("semantics-control",), "expert",
           lambda f: f.name in ("experts: silu", "experts: tokens without adapter (-1)", "experts: disabled slot",
                                "experts: router weight on input", DECODE_ROW),
           mechanisms="moe_lora_harness.suites.experts.semantic_mutants:MECHANISMS"),
    Corpus("ep", "moe_lora_harness.suites.experts.ep_mutants:MUTANTS", ("ep-control",), "expert",
           lambda f: f.name.startswith("experts: EP") and "processes" not in f.name, fuzz_level="ep"),
    # FP8 activations with LoRA (issue 22): check's two FP8 rows; fuzz draws FP8 cases only, as the mutants claim
    # nothing else (harness.draw.strategies.fp8_cases)
    Corpus("fp8", "moe_lora_harness.suites.experts.fp8_mutants:BACKENDS", ("fp8-control",), "expert",
           lambda f: f.name in ("experts: fp8 w8a8", "experts: fp8 block")),
    Corpus("reach", "moe_lora_harness.harness.selftest.reach_mutants:REACH_MUTANTS", ("reach-control",), "op",
           lambda f: f.level == "op"),
    Corpus("schedule", "moe_lora_harness.suites.schedule.planted_backends:BACKENDS", ("schedule-control",),
           "expert", lambda f: f.name in ("experts: silu", "experts: tokens without adapter (-1)",
                                          "experts: fp32", "experts: rank padding"), devices=("cpu",)),
    # the layer's life across calls: check runs the named scenarios (harness.layer.layer_scenarios), fuzz the state
    # machine (harness.layer.layer_machine); `features` is unused at this level
    Corpus("layer", "moe_lora_harness.suites.layer.layer_mutants:BACKENDS", ("layer-control", "layer-control-dual-stream"),
           "layer", lambda f: False),
    # bugs past a size gate (2^31 elements, grid axis 65535, 4096 tokens, K 4096): a GPU only, at a catalogue model's
    # shapes (production_mutants.PRODUCTION; CPU_REASON there says why not on the CPU); no feature row reaches them
    Corpus("production", "moe_lora_harness.suites.kernels.production_mutants:BACKENDS", ("production-control",),
           "expert", lambda f: False, devices=("cuda",),
           cases="moe_lora_harness.suites.kernels.production_mutants:check_cases",
           not_here=(("cpu", "Triton's CPU interpreter cannot run production shapes in CI time (a DeepSeek-V3 layer "
                             "is 11e9 weights; the interpreter runs one program at a time)"),)),
)


@dataclass
class Kill:
    """One (backend, detector) cell: caught or not, after how many seconds and runs, and the first failure."""

    caught: bool
    seconds: float
    runs: int
    first: str = ""       # the first failure's one-line summary
    error: str = ""       # the detector could not run (load error, nothing claimed)
    named: str = ""       # the semantic alternative the caught failure was named as ('' none)
    also: tuple = ()      # the other alternatives that fit that failure as well (its case cannot tell them apart)
    expected: str = ""    # the one the mutant commits ('' when its mechanism is not in the table)
    row: str = ""         # check: the row that failed first
    rows: tuple = ()      # check: every row that failed (all of them only when every row was run)

    @property
    def misnamed(self) -> bool:
        """Caught, with a mechanism in the table, but not named as it (nor among the alternatives that fit its
        failure equally: where the case cannot tell them apart, naming either is true)."""
        return self.caught and bool(self.expected) and self.expected not in (self.named, *self.also)


class BudgetSpent(Exception):
    """The deadline passed in the middle of a mutant: its detectors' cells are not kept."""


@dataclass
class SelftestResult:
    cells: dict = field(default_factory=dict)      # (corpus, backend) -> {detector: Kill}
    controls: dict = field(default_factory=dict)   # (corpus, backend) -> list of failure summaries
    skipped: dict = field(default_factory=dict)    # corpus -> why it did not run
    planned: list = field(default_factory=list)    # (corpus, backend) of every mutant and control, in run order
    check_rows: list = field(default_factory=list)  # every check row run, in the order first run
    stopped: str = ""                              # why it stopped early: budget, interrupted, error ('' finished)
    in_flight: tuple | None = None                 # the (corpus, backend) unfinished when it stopped
    running: list = field(default_factory=list)    # --jobs N: every (corpus, backend) unfinished when it stopped
    error: str = ""                                # --jobs N: a job's harness error (stopped "error")

    @property
    def not_reached(self) -> list:
        """Planned mutants and controls that did not finish (the one in flight included)."""
        return [k for k in self.planned if k not in self.cells and k not in self.controls]

    @property
    def survivors(self) -> list:
        return [k for k, cells in self.cells.items() if cells and not any(c.caught for c in cells.values())]

    @property
    def misnamed(self) -> list:
        """(corpus, backend, detector) of every catch that did not name the mutant's mechanism."""
        return [(*k, d) for k, cells in self.cells.items() for d, c in cells.items() if c.misnamed]

    @property
    def failing_controls(self) -> list:
        return [k for k, fails in self.controls.items() if fails]


def _check_rows(corpus: Corpus, spec, device: str):
    """(row name, run) for each check row of the corpus (feature cases, or the named layer scenarios) in the order
    `check --budget` runs them (harness.check.check_order): the seconds to a kill are the gate's."""
    from moe_lora_harness.harness.check.check_order import row_key, stored
    rows = list(_corpus_rows(corpus, spec, device))
    key = row_key(stored(device), [row for row, _ in rows])
    return sorted(rows, key=lambda row_run: key(row_run[0]))


def _corpus_rows(corpus: Corpus, spec, device: str):
    """_check_rows in check's own order."""
    if corpus.level == "layer":
        from moe_lora_harness.harness.layer.layer_runner import run_scenario
        from moe_lora_harness.harness.layer.layer_scenarios import claimed_scenario, layer_scenarios
        for label, sc in layer_scenarios(device):
            yield label, lambda executor, diagnose, sc=claimed_scenario(spec, sc, device): run_scenario(
                spec, sc, device, executor=executor)
        return
    if corpus.cases:
        for label, case in load_attr(corpus.cases)(spec.name):
            yield label, lambda executor, diagnose, case=case: run_case(spec, case, device, executor=executor,
                                                                        reruns=0, diagnose=diagnose)
        return
    for feat, _, case in feature_cases([f for f in FEATURES if corpus.features(f)], device, 1):
        # a mutant whose mechanism is in the table is diagnosed (only a failure costs a diagnosis)
        yield feat.name, lambda executor, diagnose, case=case: run_case(spec, case, device, executor=executor,
                                                                        reruns=0, diagnose=diagnose)


def _in_time(deadline: float | None) -> float | None:
    """Seconds left before `deadline` (None: no deadline); BudgetSpent once it has passed."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise BudgetSpent
    return left


def _check_detector(spec, corpus: Corpus, device: str, executor, stop_at_first: bool, expected: str = "", *,
                    deadline: float | None = None, step=None, seen: list | None = None) -> Kill:
    """The corpus' check rows in turn, to the first failure (`stop_at_first`) or all of them; `step(row)` is told
    each row, `seen` collects the rows run."""
    t0, runs, claimed = time.monotonic(), 0, 0
    failures, rows, first = [], [], None
    for row, run in _check_rows(corpus, spec, device):
        _in_time(deadline)
        if step:
            step(f"check: {row}")
        if seen is not None and row not in seen:
            seen.append(row)
        o = run(executor, bool(expected) and first is None)     # a mutant's first failure is diagnosed
        runs += 1
        claimed += o.judged
        if o.failed:
            failures.append(f"{row}: {o.kind} {o.message[:120]}"
                            + (f" [consistent with {o.semantics}]" if o.semantics else ""))
            rows.append(row)
            first = first or (time.monotonic() - t0, runs, o.semantics, o.semantics_also)
            if stop_at_first:
                break
    if not claimed:
        return Kill(False, time.monotonic() - t0, runs, error="declined every check row")
    if first is None:
        return Kill(False, time.monotonic() - t0, runs)
    seconds, at, named, also = first
    return Kill(True, seconds, at, "; ".join(failures[:3]), named=named, also=also, expected=expected, row=rows[0],
                rows=tuple(rows))


def _fuzz_detector(spec, corpus: Corpus, device: str, executor, budget_s: float, max_examples: int,
                   palette: str = "auto", expected: str = "", *, deadline: float | None = None) -> Kill:
    """A campaign to its first failure, within `budget_s` (and the deadline: one it cut is BudgetSpent)."""
    left = _in_time(deadline)
    k = _campaign(spec, corpus, device, executor, budget_s if left is None else min(budget_s, left), max_examples,
                  palette, expected)
    if not k.caught and left is not None and left < budget_s:
        _in_time(deadline)
    return k


def _campaign(spec, corpus: Corpus, device: str, executor, budget_s: float, max_examples: int, palette: str,
              expected: str) -> Kill:
    t0 = time.monotonic()
    if corpus.level == "layer":   # time to detection: the first failing scenario, unshrunk
        from moe_lora_harness.harness.layer.layer_machine import first_layer_failure
        found, examples, claimed = first_layer_failure(spec, device, executor, budget_s, max_examples)
        if not claimed:
            return Kill(False, time.monotonic() - t0, examples, error="nothing claimed")
        return Kill(found is not None, time.monotonic() - t0, examples, found or "")
    sizes = selftest_draw_sizes(device)
    c = Campaign(spec, device, corpus.level, executor, budget_s=budget_s, max_examples=max_examples, seed=0,
                 reruns=0, max_found=1, shrink=False)     # time to detection: the first failing example
    r = c.run(claimed_cases(spec, device, corpus.fuzz_level or corpus.level,
                            compile_classes=wants_compile_classes(palette, device), **sizes))
    if not r.claimed_any and not r.found:
        return Kill(False, time.monotonic() - t0, r.examples, error="nothing claimed")
    if r.found:
        f = r.found[0]
        return Kill(True, f.seconds, r.examples, f.signature.text, named=f.signature.semantics,
                    also=f.outcome.semantics_also, expected=expected)
    return Kill(False, time.monotonic() - t0, r.examples)


def _plan(res: SelftestResult, device: str, corpora) -> list:
    """[(corpus, spec, mechanisms)] of the chosen corpora that run here; the others in `res.skipped`."""
    dev = "cuda" if str(device).startswith("cuda") else str(device)
    plan = []
    for corpus in CORPORA:
        if corpora and corpus.name not in corpora:
            continue
        if dev not in corpus.devices:
            res.skipped[corpus.name] = dict(corpus.not_here).get(dev) or f"runs on {', '.join(corpus.devices)} only"
            continue
        try:
            specs = [s for s in load_ref(corpus.ref) if corpus.select(s)]
            mechanisms = load_attr(corpus.mechanisms) if corpus.mechanisms else {}
        except Exception as e:  # noqa: BLE001 - e.g. Triton missing: the corpus is reported as not run
            res.skipped[corpus.name] = f"{type(e).__name__}: {e}"
            continue
        plan += [(corpus, spec, mechanisms) for spec in specs]
    return plan


def run_selftest(device: str, executor, *, corpora=None, detectors=("check", "fuzz"), fuzz_budget_s: float = 20.0,
                 fuzz_max_examples: int = 200, progress=None, palette: str = "auto", deadline: float | None = None,
                 all_rows: bool = False, result: SelftestResult | None = None) -> SelftestResult:
    """Every mutant of the chosen corpora under every detector (check to its first failure, or through every row
    with `all_rows`); every control through check (all rows). It stops at `deadline` (time.monotonic()) with what
    finished; `result` is filled as it goes (a caller that catches KeyboardInterrupt keeps it); `progress` (a
    selftest_progress.SelftestProgress) is told each mutant's start, step and end."""
    res = result if result is not None else SelftestResult()
    plan = _plan(res, device, corpora)
    res.planned = [(corpus.name, spec.name) for corpus, spec, _ in plan]
    if progress:
        progress.begin(len(plan))
    for corpus, spec, mechanisms in plan:
        key = res.in_flight = (corpus.name, spec.name)
        t0 = time.monotonic()
        step = (lambda what, key=key: progress.step(key, what)) if progress else None
        if progress:
            progress.start(key)
        try:
            kind, value = run_entry(corpus, spec, mechanisms, device, executor, detectors=detectors,
                                    fuzz_budget_s=fuzz_budget_s, fuzz_max_examples=fuzz_max_examples, palette=palette,
                                    deadline=deadline, all_rows=all_rows, step=step, seen=res.check_rows)
        except BudgetSpent:
            res.stopped = "budget"
            return res
        (res.controls if kind == "control" else res.cells)[key] = value
        res.in_flight = None
        if progress:
            progress.finished(key, res, time.monotonic() - t0)
    return res


def run_entry(corpus: Corpus, spec, mechanisms: dict, device: str, executor, *, detectors, fuzz_budget_s: float,
              fuzz_max_examples: int, palette: str, deadline: float | None, all_rows: bool, step=None,
              seen: list | None = None) -> tuple:
    """One mutant or control of the plan: ("cells", {detector: Kill}) or ("control", its failures); BudgetSpent
    past `deadline`; `seen` collects the check rows a mutant ran."""
    if spec.name in corpus.controls:
        k = _check_detector(spec, corpus, device, executor, stop_at_first=False, deadline=deadline, step=step)
        return "control", ([k.first] if k.caught else []) + ([k.error] if k.error else [])
    return "cells", _mutant_cells(spec, corpus, device, executor, detectors, mechanisms.get(spec.name, ""),
                                  fuzz_budget_s, fuzz_max_examples, palette, deadline, all_rows, step, seen)


def run_selftest_jobs(device: str, jobs: int, *, in_process: bool = False, timeout: float | None = None,
                      corpora=None, detectors=("check", "fuzz"), fuzz_budget_s: float = 20.0,
                      fuzz_max_examples: int = 200, progress=None, palette: str = "auto",
                      deadline: float | None = None, all_rows: bool = False,
                      result: SelftestResult | None = None) -> SelftestResult:
    """run_selftest in `jobs` job processes (harness.execution.job_pool): the mutants and controls handed out as jobs come free
    (the controls first: they run every check row; none after the deadline), `result` filled as each finishes and
    put in plan order at the end, so that its kill matrix is a one-job run's. A job's harness error stops it
    ("error", `res.error`)."""
    from moe_lora_harness.harness.execution.job_pool import serve
    res = result if result is not None else SelftestResult()
    plan = _plan(res, device, corpora)
    res.planned = [(corpus.name, spec.name) for corpus, spec, _ in plan]
    seen, cut = {}, []
    if progress:
        progress.begin(len(plan))

    def task(i):
        left = None if deadline is None else deadline - time.monotonic()
        if res.stopped or (left is not None and left <= 0):
            res.stopped = res.stopped or "budget"
            return None
        return (*res.planned[i], left)

    def started(i):
        if progress:
            progress.start(res.planned[i])

    def finished(i, result, seconds):
        kind, value, rows = result
        key = res.planned[i]
        seen[key] = rows
        if kind == "budget":
            res.stopped = "budget"
            cut.append(key)
            return
        (res.controls if kind == "control" else res.cells)[key] = value
        if progress:
            progress.finished(key, res, seconds)
    options = {"device": device, "in_process": in_process, "timeout": timeout, "detectors": tuple(detectors),
               "fuzz_budget_s": fuzz_budget_s, "fuzz_max_examples": fuzz_max_examples, "palette": palette,
               "all_rows": all_rows}
    try:
        order = sorted(range(len(plan)), key=lambda i: plan[i][1].name not in plan[i][0].controls)
        served = serve("moe_lora_harness.harness.selftest.selftest:selftest_job", options, len(plan), jobs, task=task,
                       started=started, finished=finished, order=order)
    finally:
        _in_plan_order(res, seen)
    failed = [res.planned[i] for i, _ in served.errors if i is not None]
    if served.errors:
        res.stopped, res.error = "error", "\n".join(text for _, text in served.errors)
    elif served.interrupted:
        res.stopped = "interrupted"
    res.running = [k for k in res.planned if k in set(failed) | set(cut) | {res.planned[i] for i in served.in_flight}]
    res.in_flight = res.running[0] if res.running else None
    return res


def _in_plan_order(res: SelftestResult, seen: dict) -> None:
    """The cells and controls in plan order, and the check rows in the order a one-job run first runs them."""
    order = {k: n for n, k in enumerate(res.planned)}
    res.cells = dict(sorted(res.cells.items(), key=lambda kv: order[kv[0]]))
    res.controls = dict(sorted(res.controls.items(), key=lambda kv: order[kv[0]]))
    rows = []
    for key in res.planned:
        rows += [r for r in seen.get(key, ()) if r not in rows]
    res.check_rows[:] = rows


class _SelftestJob:
    """One job of `selftest --jobs N` (harness.execution.job_pool): its own executor; runs (corpus, backend, seconds left)."""

    def __init__(self, options: dict):
        from moe_lora_harness.harness.execution.device import prepare_device
        from moe_lora_harness.harness.execution.worker import executor_for
        self.o = options
        prepare_device(options["device"])
        self.executor = executor_for(options["in_process"], options["timeout"])
        self.corpora = {}

    def _entry(self, corpus_name: str, backend: str):
        """(corpus, spec, mechanisms) of one entry of the parent's plan (its corpus loaded once per job)."""
        if corpus_name not in self.corpora:
            self.corpora[corpus_name] = {spec.name: (corpus, spec, mechanisms) for corpus, spec, mechanisms
                                         in _plan(SelftestResult(), self.o["device"], (corpus_name,))}
        return self.corpora[corpus_name][backend]

    def run(self, what) -> tuple:
        """(kind, value, the check rows run): kind "cells", "control" or "budget" (cut by the deadline, not kept)."""
        corpus_name, backend, left = what
        corpus, spec, mechanisms = self._entry(corpus_name, backend)
        o, seen = self.o, []
        try:
            kind, value = run_entry(corpus, spec, mechanisms, o["device"], self.executor, detectors=o["detectors"],
                                    fuzz_budget_s=o["fuzz_budget_s"], fuzz_max_examples=o["fuzz_max_examples"],
                                    palette=o["palette"], deadline=None if left is None else time.monotonic() + left,
                                    all_rows=o["all_rows"], seen=seen)
        except BudgetSpent:
            return "budget", None, seen
        return kind, value, seen

    def close(self) -> dict:
        self.executor.close()
        return {"restarts": getattr(self.executor, "restarts", 0)}


def selftest_job(options: dict) -> _SelftestJob:
    """job_pool's entry for selftest."""
    return _SelftestJob(options)


def _mutant_cells(spec, corpus, device, executor, detectors, expected, fuzz_budget_s, fuzz_max_examples, palette,
                  deadline, all_rows, step, seen) -> dict:
    """One mutant's {detector: Kill}."""
    cells = {}
    if "check" in detectors:
        cells["check"] = _check_detector(spec, corpus, device, executor, stop_at_first=not all_rows,
                                         expected=expected, deadline=deadline, step=step, seen=seen)
    if "fuzz" in detectors:
        if step:
            step(f"fuzz ({fuzz_budget_s:g}s, {fuzz_max_examples} examples at most)")
        cells["fuzz"] = _fuzz_detector(spec, corpus, device, executor, fuzz_budget_s, fuzz_max_examples, palette,
                                       expected=expected, deadline=deadline)
    return cells


def verdict(cells: dict) -> str:
    """One mutant's verdict in a line: killed (by which detector, at which check row, after how long), MISNAMED or
    SURVIVED."""
    parts = []
    for d, k in cells.items():
        if k.misnamed:
            parts.append(f"{d} named it {k.named or 'nothing'}, it commits {k.expected}")
        elif k.caught:
            parts.append(f"by {d}" + (f" at {k.row!r}" if k.row else "") + f" in {k.seconds:.1f}s")
        else:
            parts.append(f"{d} survived" + (f" ({k.error})" if k.error else f" ({k.runs} runs)"))
    head = ("MISNAMED" if any(k.misnamed for k in cells.values()) else
            "killed" if any(k.caught for k in cells.values()) else "SURVIVED")
    return f"{head}: " + "; ".join(parts)


def control_verdict(fails: list) -> str:
    return "control FAILED: " + "; ".join(fails) if fails else "control passes"


def _killed(k: Kill) -> str:
    text = f"killed {k.seconds:.1f}s ({k.runs} runs)"
    if k.expected:
        text += ", named" if not k.misnamed else f", MISNAMED ({k.named or 'no name'}; commits {k.expected})"
    return text


def kill_matrix_text(res: SelftestResult, detectors) -> str:
    """The kill matrix (mutant x detector) and the controls' verdicts as text."""
    w = max([len(f"{c}/{b}") for c, b in list(res.cells) + list(res.controls)] + [10])
    lines = [f"{'mutant':<{w}}  " + "  ".join(f"{d:<22}" for d in detectors), "-" * (w + 24 * len(detectors))]
    for (corpus, name), cells in res.cells.items():
        row = []
        for d in detectors:
            k = cells.get(d)
            row.append("-" if k is None else (_killed(k) if k.caught else
                                              f"survived{' (' + k.error + ')' if k.error else ''}"))
        lines.append(f"{corpus + '/' + name:<{w}}  " + "  ".join(f"{r:<22}" for r in row))
    for (corpus, name), fails in res.controls.items():
        lines.append(f"{corpus + '/' + name:<{w}}  control: " + ("FAILED: " + "; ".join(fails) if fails else "passes"))
    for corpus, why in res.skipped.items():
        lines.append(f"corpus {corpus} not run: {why}")
    if res.stopped:
        running = res.running or ([res.in_flight] if res.in_flight else [])
        lines.append(f"\nPARTIAL ({STOPPED[res.stopped]}): {len(res.planned) - len(res.not_reached)} of "
                     f"{len(res.planned)} mutants and controls finished"
                     + (f"; in flight: {', '.join('/'.join(k) for k in running)}" if running else ""))
        lines.append("not reached: " + ", ".join("/".join(k) for k in res.not_reached))
    return "\n".join(lines)


STOPPED = {"budget": "the --budget was spent", "interrupted": "interrupted", "error": "a harness error"}


def junit_cases(res: SelftestResult) -> list:
    cases = []
    for (corpus, name), cells in res.cells.items():
        for d, k in cells.items():
            cases.append(dict(classname=f"selftest.{corpus}.{name}", name=d, seconds=k.seconds,
                              status="fail" if k.misnamed else "pass" if k.caught else "skip" if k.error else "fail",
                              message=(f"caught but named {k.named or 'nothing'}, not {k.expected}: {k.first}"
                                       if k.misnamed else
                                       k.first or k.error or "the planted bug survived this detector")))
        cases.append(dict(classname=f"selftest.{corpus}.{name}", name="any detector", seconds=0.0,
                          status="pass" if any(k.caught for k in cells.values()) else "fail",
                          message="" if any(k.caught for k in cells.values()) else "survived every detector"))
    for (corpus, name), fails in res.controls.items():
        cases.append(dict(classname=f"selftest.{corpus}.{name}", name="control passes", seconds=0.0,
                          status="fail" if fails else "pass", message="; ".join(fails)))
    for corpus, name in res.not_reached:
        cases.append(dict(classname=f"selftest.{corpus}.{name}", name="not reached", seconds=0.0, status="skip",
                          message=f"not finished: {STOPPED[res.stopped]}" if res.stopped else "not finished"))
    return cases
