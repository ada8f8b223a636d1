"""Judge one case against one backend: expectations (float64 truth + emulation), execution, comparison.

The judge never trusts the process the backend ran in: it builds the inputs and the reference itself,
checks that the backend saw those very inputs, that it wrote none of them, and compares the output it
returned. Execution goes through an executor: `harness.execution.worker.Supervisor` (a supervised child process:
crashes and hangs become failures) or `harness.execution.execute.InProcess`. A failing case is run again
`reruns` times; if its outcome changes it is reported as nondeterministic, with every outcome.
Every failure carries the case as JSON and a `REPRO:` command that replays it alone in a fresh shell.
"""
from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass, field

import torch

from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.judge.compare import Verdict, differing_tokens, format_worst
from moe_lora_harness.harness.spec.contract import BackendSpec, known_bug_for, must_reject, support_for
from moe_lora_harness.harness.judge.diagnose import diagnose as diagnose_precision
from moe_lora_harness.harness.execution.execute import NO_MEMORY, Execution, InProcess, inputs_digest
from moe_lora_harness.harness.build.guards import outside_message
from moe_lora_harness.harness.judge.expectation import (Rules, declared_rounding, emulate_twin, held_to, judge_output,
                                                        judging, op_expectations, row_groups, twin_applies,
                                                        twin_judged, twin_truth, with_twin)
from moe_lora_harness.harness.execution.interpreter import cannot_run_here
from moe_lora_harness.harness.judge.semantic_diagnosis import failing_rows, locate, semantic_diagnosis
from moe_lora_harness.harness.judge.zero_sign import SIGN_OF_ZERO, sign_of_zero_only, sign_of_zero_text

# an Outcome's statuses, worst first: a check-matrix cell shows the worst of its outcomes (harness.check.report).
# not-runnable: the case ran where its result says nothing about the kernel (harness.execution.interpreter): no verdict
STATUSES = ("fail", "xpass", "pass", "xfail", "works-unclaimed", "not-runnable", "unsupported")
NO_VERDICT = ("unsupported", "not-runnable")     # declined by the backend / not runnable on this machine
DEFAULT_RERUNS = 2


class MalformedCase(ValueError):
    """The case itself is not a well-formed input (a usage error, never a backend's failure)."""


@dataclass
class Outcome:
    """What happened to one (backend, case) pair. `kind` names a failure's class (see FAILURE_KINDS)."""

    backend: str
    case: Case
    device: str
    status: str
    reason: str = ""
    verdict: Verdict | None = None
    detail: str = ""
    kind: str = ""
    runs: list = field(default_factory=list)    # each run's signature, when the case was run more than once
    seconds: float = 0.0
    message: str = ""                           # a failure's one-line message (exception type and text, bound)
    repro: str = ""                             # a failure's REPRO command (`repro_command`)
    probed: bool = False                        # a declined case run anyway (--probe-unsupported): `kind` is how
                                                # it failed, as declared
    semantics: str = ""                         # the integration mistake a gross failure follows (harness.
                                                # semantic_diagnosis; '' when none was named or none was tried)
    semantics_also: tuple = ()                  # the other mistakes that fit as well (the case cannot tell them
                                                # apart from `semantics`)

    @property
    def failed(self) -> bool:
        return self.status in ("fail", "xpass")

    @property
    def judged(self) -> bool:
        """A verdict was reached: the case was neither declined nor unrunnable on this machine."""
        return self.status not in NO_VERDICT


# The comparison's kinds for an output with wrong values (written elements off, untouched ones changed): the
# kinds a semantic diagnosis names, and one class of failure once a mistake is named (harness.search.signatures).
WRONG_VALUE_KINDS = ("element", "aggregate", "untouched")

# Failure kinds, as reported: the comparison's (nonfinite, untouched, element, aggregate, shape) and these.
FAILURE_KINDS = ("raised", "crash", "timeout", "load", "worker", "input-written", "outside-written", "inputs-differ",
                 "nondeterministic", "declaration", "accepted", "unclear-error", "environment", "not-invariant")
# outside-written: it wrote outside its tensors' elements (the guard bands around them, harness.build.guards);
# environment: the backend's setup failed, or it raised its own environment check (contract.ENVIRONMENT_ERRORS):
# a failure of the run's environment, not of the kernel;
# accepted: a configuration the contract rejects (contract.must_reject) ran instead of raising;
# unclear-error: it raised, but the message does not name the setting;
# not-invariant: a view of the case (harness.build.properties) gave other bits than the plain case, where the backend
# declares batch invariance


def repro_command(spec: BackendSpec, case: Case, device: str, timeout: float | None = None) -> str:
    """One shell command that replays this case alone, from any directory of a fresh shell (with the run's
    `timeout` per call when it is not the default, so that a hang replays as one)."""
    from moe_lora_harness.harness.spec.registry import harness_command, replay_prefix
    from moe_lora_harness.harness.execution.worker import DEFAULT_TIMEOUT
    env, backend = replay_prefix(spec)
    setup = f" --setup {shlex.quote(spec.setup)}" if isinstance(spec.setup, str) else ""
    wait = f" --timeout {timeout:g}" if timeout is not None and timeout != DEFAULT_TIMEOUT else ""
    return (f"{env}{harness_command()} replay{backend}{setup} --only {shlex.quote(spec.name)} --device {device}"
            f"{wait} --case {shlex.quote(case.to_json())}")


@dataclass
class Expectation:
    """The judge's side of a case: its own inputs, the truth, the emulation, the poison mask, all where the judge
    computes (a CUDA run's device, else the CPU: harness.build.builders.build_device). A judge on a GPU releases the
    inputs once the reference is computed (they are the size of the layer); `inputs` rebuilds them from the case,
    bit for bit, if a failure's report needs them."""

    built: object                              # the inputs, or None once released
    digest: str
    truth: object
    emulation: object
    poison: torch.Tensor | None = None         # on the CPU: it is sent to the worker
    before: torch.Tensor | None = None
    precision: str = ""                        # the rounding model the backend declares for the case here
    case: Case | None = None
    device: str = "cpu"                        # where the inputs are (re)built
    groups: dict | None = None                 # rule 4's row labellings (expectation.row_groups), kept past a release
    points_only: bool = False                  # the backend rounds only where its model does (rule 4's allowance)
    run_device: str | None = None              # where the backend runs (what the FP8 accumulation term follows)
    twin_digest: str = ""                      # of the reordered view's inputs, where the judge runs a twin
                                               # (expectation.twin_applies); '' where it does not
    mma: int | str | None = None               # the e4m3 MMA the emulation runs (expectation.modelled_mma)
    twin_emulation: torch.Tensor | None = None  # the twin's own emulation, in the plain columns, where it has one
                                                # (expectation.twin_own_emulation)
    twin_truth: object = None                   # the twin's own truth, where it has one (expectation.twin_own_truth)

    @property
    def rules(self) -> Rules:
        """How the output is judged beyond the truth (the verdict and every diagnosis alike)."""
        return Rules(self.run_device, self.points_only, self.groups, mma=self.mma)

    def rules_with(self, twin: torch.Tensor | None) -> Rules:
        """`rules`, holding the judged run to `twin` (the other run of a twin pair; None: none)."""
        return with_twin(self.rules, self.case, twin)

    @property
    def inputs(self):
        if self.built is None:
            self.built = _build(self.case, self.device)
        return self.built

    def release_inputs(self) -> None:
        """Drop the inputs (the comparison needs only the truth, the emulation and `before`)."""
        self.built = None


def _build(case: Case, device):
    from moe_lora_harness.harness.build.builders import build_expert_inputs, build_op_inputs
    return build_op_inputs(case, device) if case.level == "op" else build_expert_inputs(case, device)


def expectations(spec: BackendSpec, case: Case, device: str, declared: tuple | None = None) -> Expectation:
    """Everything the judge needs before the backend runs on `device` (computed once for all reruns), computed on
    that device when it is a CUDA device (in this process, never the backend's), on the CPU for a small case
    (harness.build.builders.draw_device). `declared`: `declared_rounding`'s answer, where the caller has it."""
    from moe_lora_harness.harness.build.builders import draw_device
    from moe_lora_harness.harness.execution.execute import release_device_memory
    precision, points_only, mma = declared if declared is not None else declared_rounding(spec, case, device)
    at = str(draw_device(case, device))
    exp = _expectations(case, precision, at, mma)
    exp.mma = mma
    exp.precision, exp.case, exp.device = precision, case, at
    exp.points_only = points_only
    exp.run_device = device
    if exp.truth is not None:
        # taken while the inputs are alive: reading them after a release rebuilt the whole layer for two small tensors
        groups = row_groups(exp.built, exp.truth)
        exp.groups = None if groups is None else {k: v.clone() for k, v in groups.items()}
        if twin_applies(case, device, mma, points_only):   # the twin's inputs, digested (and emulated where it
            # has its own emulation): the plain ones are permuted in place, then released
            from moe_lora_harness.harness.build.properties import view_inputs
            view = view_inputs(exp.built, "reordered", in_place=True)
            exp.twin_digest = inputs_digest(view)
            exp.twin_emulation = emulate_twin(case, precision, view, at, mma)
            exp.twin_truth = twin_truth(case, view)
            exp.release_inputs()
    if at != "cpu":     # the worker needs the GPU next: keep the (T, H)-sized results, not the layer
        exp.release_inputs()
        release_device_memory(at)
    return exp


def _expectations(case: Case, precision: str, device: str = "cpu", mma=None) -> Expectation:
    if case.level == "op":
        inputs, truth, emu = op_expectations(case, precision, device)
        digest = inputs_digest(inputs)   # before poisoning: the worker digests its inputs as built, too
        poison = None
        before = inputs.output.clone()
        if not case.add_inputs:      # the contract does not read these: poison them so a missed write shows
            poison = truth.written.to("cpu", copy=True)
            before[truth.written] = float("nan")
        return Expectation(inputs, digest, truth, emu, poison, before)
    if must_reject(case) is not None:   # nothing to compute: the backend must refuse to run
        from moe_lora_harness.harness.build.builders import build_expert_inputs
        inp = build_expert_inputs(case, device)
        return Expectation(inp, inputs_digest(inp), None, None)
    from moe_lora_harness.harness.build.expert_runner import expert_expectations
    inp, truth, emu = expert_expectations(case, precision, device=device, mma=mma)
    return Expectation(inp, inputs_digest(inp), truth, emu)


def _judge_rejection(case: Case, ex: Execution) -> tuple[str, str, None]:
    """A rejected configuration passes only by raising an error that names the setting."""
    import re
    rej = must_reject(case)
    f = ex.failure
    if f is None:
        return "accepted", (f"the backend ran {rej.what} instead of refusing it: it must raise an error naming the "
                            f"setting (matching /{rej.names}/)"), None
    if f.kind != "raised" or f.exc_type in ("SystemExit", "KeyboardInterrupt"):
        return f.kind, f.message, None
    if not re.search(rej.names, f.message, re.I):
        return "unclear-error", (f"the backend refused {rej.what}, but its error does not name the setting "
                                 f"(/{rej.names}/): {f.exc_type}: {f.message[:300]}"), None
    return "pass", "", None


def _is_environment(spec: BackendSpec, message: str) -> bool:
    import re

    from moe_lora_harness.harness.spec.contract import ENVIRONMENT_ERRORS
    return any(re.search(p, message, re.I) for p in (*ENVIRONMENT_ERRORS, *spec.environment_errors))


def _judge_execution(case: Case, exp: Expectation, ex: Execution, spec: BackendSpec | None = None,
                     twin: torch.Tensor | None = None, emulation: torch.Tensor | None = None
                     ) -> tuple[str, str, Verdict | None]:
    """(kind, message, verdict): kind 'pass' or a failure kind. `twin`: the output the run is held to as its twin
    (rule 4; None: none); `emulation`: the run's own (a twin's, `Expectation.twin_emulation`; None: the case's)."""
    if ex.failure is not None and ex.failure.kind == "raised" and spec is not None \
            and _is_environment(spec, ex.failure.message):
        f = ex.failure
        return "environment", (f"the backend's own environment check failed ({f.exc_type}: {f.message}); "
                               f"give it the environment it needs (BackendSpec.setup, or --setup MODULE:ATTR)"), None
    if must_reject(case) is not None:
        return _judge_rejection(case, ex)
    if ex.failure is not None:
        f = ex.failure
        return f.kind, (f"{f.exc_type}: {f.message}" if f.exc_type and f.kind == "raised" else f.message), None
    if ex.built_digest != exp.digest:
        return "inputs-differ", ("the worker built other inputs than the judge did (the backend changed the "
                                 "worker's global state, e.g. torch's RNG or a harness function)"), None
    verdict = judge_output(case, ex.output, exp.truth, exp.emulation.value if emulation is None else emulation,
                           exp.precision, exp.rules_with(twin), exp.before)
    if ex.inputs_written:
        return "input-written", (f"the backend wrote its input(s) {', '.join(ex.inputs_written)} (inputs are "
                                 f"read-only; compared bit for bit before and after the call)"), verdict
    if ex.outside_written:
        return "outside-written", outside_message("the backend", ex.outside_written, "the call"), verdict
    if not verdict.ok:
        return verdict.kind, verdict.message, verdict
    return "pass", "", verdict


TWIN_RUN = ("its twin run (view 'reordered': the case with the dimensions it sums over permuted, every long sum "
            "in another order)")
# how the twin was judged: with the plain run as its twin, or (expectation.twin_own_truth) alone
HELD_TO_PLAIN, ON_ITS_OWN = ", judged with the plain run as its twin", (
    ", every LoRA B scaled, judged alone against its own truth")


def _judge_twins(case: Case, exp: Expectation, ex: Execution, twin: Execution | None, spec: BackendSpec
                 ) -> tuple[str, str, Verdict | None, Execution, torch.Tensor | None, torch.Tensor | None]:
    """(kind, message, verdict, the run that verdict is of, the twin output it was held to, that run's own emulation
    or None for the case's): the plain run judged with its twin (the reordered view's run,
    `expectation.twin_applies`; None: no twin), and, if it passes, the twin judged likewise, with the plain run as its
    twin (each against its own emulation where it has one: `expectation.held_to`). Either run's failure is the
    case's."""
    from moe_lora_harness.harness.build.properties import twin_columns
    if twin is None:
        return (*_judge_execution(case, exp, ex, spec), ex, None, None)
    usable = twin.failure is None and twin.output is not None and exp.truth is not None \
        and tuple(twin.output.shape) == tuple(exp.truth.value.shape)
    mirrored = dataclasses.replace(twin, output=twin_columns(twin.output, case) if usable
                                   else twin.output,
                                   built_digest=exp.digest if twin.built_digest == exp.twin_digest else "?")
    emu, twin_emu = exp.emulation.value, exp.twin_emulation
    own = emu if twin_emu is None else twin_emu
    plain_held = held_to(mirrored.output, own, emu) if usable else None
    first = _judge_execution(case, exp, ex, spec, plain_held)
    if first[0] != "pass":
        return (*first, ex, plain_held, None)
    judged_truth, twin_held = twin_judged(exp.truth, exp.twin_truth, ex.output, emu, own)
    judged = exp if judged_truth is exp.truth else dataclasses.replace(exp, truth=judged_truth)
    kind, message, verdict = _judge_execution(case, judged, mirrored, spec, twin_held, twin_emu)
    if kind == "pass":
        return (*first, ex, plain_held, None)
    how = ON_ITS_OWN if exp.twin_truth is not None else HELD_TO_PLAIN
    return kind, f"{TWIN_RUN}{how}: {message}", verdict, mirrored, twin_held, twin_emu


def _twin_side(exp: Expectation) -> Expectation:
    """The expectation a twin judged against its own truth failed (expectation.twin_own_truth): its truth and its
    inputs (the reordered view of the case's), so that the diagnoses re-judge it as its verdict did."""
    from moe_lora_harness.harness.build.properties import view_inputs
    return dataclasses.replace(exp, truth=exp.twin_truth, built=view_inputs(exp.inputs, "reordered"))


def _judge_view(spec: BackendSpec, case: Case, device: str, executor, ex: Execution) -> tuple[str, str, str]:
    """(kind, message, note) of a view that passed the reference: its rows against the plain case's run, bit for
    bit where the backend declares batch invariance; elsewhere identical rows are only noted."""
    from moe_lora_harness.harness.build.properties import TOKEN_VIEWS, VIEW_MEANING
    if case.view not in TOKEN_VIEWS:     # another summation order: its bits may differ, its values are judged
        return "pass", "", ""
    plain = executor.execute(spec, case.replace(view=""), device, None)
    if plain.failure is not None:
        f = plain.failure
        return f.kind, f"the plain case (no view) failed, so the view cannot be compared: {f.message}", ""
    diff = differing_tokens(ex.output, plain.output, case.view)
    if spec.capabilities.batch_invariant and diff:
        return "not-invariant", (f"view {case.view!r} ({VIEW_MEANING[case.view]}): {len(diff)} token row(s) differ "
                                 f"bit for bit from the plain run (tokens {diff[:8]}), but the backend declares "
                                 f"batch invariance"), ""
    if not spec.capabilities.batch_invariant and not diff:
        return "pass", "", (f"view {case.view!r}: bit-identical to the plain run (batch invariance could be "
                            f"declared)")
    return "pass", "", ""


def _signature(kind: str, ex: Execution) -> str:
    if kind in ("raised", "crash") and ex.failure is not None:
        return ex.failure.signature
    return kind


def run_case(spec: BackendSpec, case: Case, device: str = "cpu", *, probe: bool = False, executor=None,
             reruns: int = DEFAULT_RERUNS, diagnose: bool = True) -> Outcome:
    """Judge one case: unsupported (with the declared reason), pass, fail, xfail/xpass per the ledger.

    With `probe`, a case the backend declines is run anyway; if it passes the outcome is
    `works-unclaimed` (reported, not a failure). A malformed case raises MalformedCase. `diagnose`: re-judge
    a bound failure against alternative rounding models (harness/judge/diagnose.py; a fuzz search turns it off
    while shrinking).
    """
    problems = case.problems()
    if problems:
        raise MalformedCase(f"malformed case {case.to_json()}: " + "; ".join(problems))
    try:   # the backend's own declarations (rules, precision function) run here: their errors are its failures
        ok, reason = support_for(spec, case, device)
        declared = declared_rounding(spec, case, device) if (ok or probe) else None
    except Exception as e:  # noqa: BLE001
        import traceback
        message = (f"the backend's declaration raised {type(e).__name__}: {e} (a Rule, its precision function or its "
                   f"fp8_mma)")
        repro = repro_command(spec, case, device, getattr(executor, "timeout", None))
        detail = "\n".join([f"FAIL backend={spec.name} case={case.id} device={device} kind=declaration",
                            f"  {message}", "  " + "".join(traceback.format_exception(e)[-3:]).strip(),
                            f"CASE: {case.to_json()}", f"REPRO: {repro}"])
        return Outcome(spec.name, case, device, "fail", "declaration", None, detail, kind="declaration",
                       message=message, repro=repro)
    if not ok and not probe:
        return Outcome(spec.name, case, device, "unsupported", reason)
    exp = expectations(spec, case, device, declared)   # the harness's own reference: its errors are ours, raised
    if case.dispatched:
        from moe_lora_harness.harness.execution.ep_ranks import driver_problem
        problem = driver_problem(case, device)
        if problem:   # the machine, not the backend: declared as a skip with its reason
            return Outcome(spec.name, case, device, "not-runnable", f"not runnable on this machine: {problem}")
    executor = executor or InProcess()

    def execute() -> tuple[Execution, Execution | None]:     # the run, and its twin where the judge runs one
        first = executor.execute(spec, case, device, exp.poison)
        if not exp.twin_digest or first.failure is not None:
            return first, None
        return first, executor.execute(spec, case.replace(view="reordered"), device, exp.poison)

    ex, twin = execute()
    short = next((e.failure for e in (ex, twin) if e is not None and e.failure is not None
                  and e.failure.kind == NO_MEMORY), None)
    if short is not None:   # the harness's own inputs did not fit: the machine's limit, no verdict on the backend
        return Outcome(spec.name, case, device, "not-runnable", f"not runnable on this machine: {short.message}",
                       seconds=ex.seconds)
    not_here = cannot_run_here(ex.launches) if must_reject(case) is None else ""
    if not_here:   # the machine cannot compute what the kernel computes: neither a pass nor a failure
        return Outcome(spec.name, case, device, "not-runnable", not_here, seconds=ex.seconds)
    seconds = ex.seconds + (twin.seconds if twin is not None else 0.0)
    kind, message, verdict, ex, held, own_emulation = _judge_twins(case, exp, ex, twin, spec)
    runs = []
    if kind not in ("pass", "timeout", "environment") and reruns > 0 and ok:
        # a failure is run again (a hang is not: it would cost the timeout again); a changed outcome means
        # the backend is nondeterministic, and that is the failure reported, with every run's outcome
        runs = [_signature(kind, ex)]
        for _ in range(reruns):
            ex_i, twin_i = execute()
            seconds += ex_i.seconds + (twin_i.seconds if twin_i is not None else 0.0)
            kind_i, _, _, judged_i, _, _ = _judge_twins(case, exp, ex_i, twin_i, spec)
            runs.append(_signature(kind_i, judged_i))
        if len(set(runs)) > 1:
            kind = "nondeterministic"
            message = (f"the outcome changed between {len(runs)} runs of the same case: "
                       + ", ".join(f"run {i + 1} {r}" for i, r in enumerate(runs)) + f"; run 1: {message}")
    note = ""
    if case.view and ok and kind == "pass":
        kind, message, note = _judge_view(spec, case, device, executor, ex)
    passed = kind == "pass"
    if not ok:   # probing an unclaimed case
        if passed:
            return Outcome(spec.name, case, device, "works-unclaimed",
                           f"declared unsupported ({reason}) but passes", verdict, seconds=seconds)
        return Outcome(spec.name, case, device, "unsupported", reason, verdict, seconds=seconds, kind=kind,
                       message=message, probed=True)
    bug = known_bug_for(spec, case, exp.before, judging(case, exp.truth)[0] if exp.truth is not None else None)
    if bug is not None:
        if passed:
            repro = repro_command(spec, case, device, getattr(executor, "timeout", None))
            return Outcome(spec.name, case, device, "xpass",
                           f"known bug {bug.issue} ({bug.description}) did not reproduce: close the ledger entry",
                           verdict, _explain(spec, case, device, "xpass", "ledger entry did not reproduce",
                                             verdict, ex, exp, repro), kind="xpass", seconds=seconds, repro=repro)
        return Outcome(spec.name, case, device, "xfail", f"known bug {bug.issue}: {bug.description}", verdict,
                       kind=kind, seconds=seconds)
    if passed:
        return Outcome(spec.name, case, device, "pass", note, verdict, seconds=seconds)
    repro = repro_command(spec, case, device, getattr(executor, "timeout", None))
    judged = _twin_side(exp) if own_emulation is not None and exp.twin_truth is not None else exp
    notes, semantics, also = (_diagnoses(case, kind, verdict, ex, judged, held, own_emulation) if diagnose
                              else ([], "", ()))
    return Outcome(spec.name, case, device, "fail", kind, verdict,
                   _explain(spec, case, device, kind, message, verdict, ex, exp, repro, notes), kind=kind,
                   runs=runs, seconds=seconds, message=message, repro=repro, semantics=semantics,
                   semantics_also=also)


def _op_coords(case: Case, cpu):
    ids, mapping = cpu.topk_ids, cpu.token_lora_mapping

    def coords(idx):
        t, j, col = idx
        s = (col - case.offset) // case.N if col >= case.offset else -1
        return f"expert={int(ids[t, j])} lora={int(mapping[t])} slice={s}"
    return coords


def _expert_coords(case: Case, inp):
    ids, mapping = inp.topk_ids, inp.token_lora_mapping

    def coords(idx):
        t = idx[0]
        where = f"ep_rank={case.rank_of_token(t)} " if case.dispatched else ""
        return f"{where}experts={ids[t].tolist()} lora={int(mapping[t])}"
    return coords


# the diagnosis of a bound failure of a backend declared to round only at its model's points whose output the judge
# passes without that declaration
UNDECLARED_PASS = ("judged as a backend that does not declare model_points_only (one more rounding of every value "
                   "allowed, and with FP8 activations the flips another scale arithmetic takes at e4m3 ties), the "
                   "output passes: it rounds where its model does not, and if that is meant the declaration is the "
                   "mistake")


def _diagnoses(case: Case, kind: str, verdict, ex: Execution, exp: Expectation,
               twin: torch.Tensor | None = None, emulation: torch.Tensor | None = None) -> tuple[list, str]:
    """(report lines, the named semantic alternative or ''): the rounding model a bound failure follows
    (harness.judge.diagnose); beyond every rounding model, the integration mistake (harness.judge.semantic_diagnosis);
    and, when only some rows fail, which they are; each under the verdict's rules (`twin`: the output the run was
    held to; `emulation`: the run's own, None for the case's); and whether the output passes without the backend's
    model_points_only declaration (UNDECLARED_PASS). Advice only: its own failure is reported, never raised."""
    if verdict is None or ex.output is None or kind not in (*WRONG_VALUE_KINDS, "nonfinite"):
        return [], "", ()
    lines, name, also = [], "", ()
    rules = exp.rules_with(twin)
    emu = exp.emulation.value if emulation is None else emulation
    try:
        d = None
        if kind in ("element", "aggregate"):
            d = diagnose_precision(case, exp.precision, ex.output, exp.truth, inputs=exp.inputs,
                                   emulation=emu, rules=rules)
            lines.append("  precision: " + (d.text if d is not None
                                            else "the error is too large for any rounding model"))
        if kind != "nonfinite" and (d is None or not d.matched):
            s = semantic_diagnosis(case, exp.precision, ex.output, exp.inputs, exp.truth, emu,
                                   verdict.ratio if kind != "untouched" else None, before=exp.before, rules=rules)
            n = (kind == "untouched" and s is not None and not s.name
                 and sign_of_zero_only(case, exp.precision, ex.output, exp.truth, emu, exp.before,
                                       rules=rules))
            if n:      # no mistake of the table fits, and only zeros changed sign: said so (harness.judge.zero_sign)
                lines.append("  semantics: " + sign_of_zero_text(n))
                name = SIGN_OF_ZERO
            elif s is not None:
                lines.append("  semantics: " + s.text)
                name, also = s.name, tuple(f.name for f in s.matched[1:])
        where = locate(case, exp.inputs, failing_rows(case, exp.precision, ex.output, exp.truth,
                                                      emu, exp.before, rules))
        if where:
            lines.append("  rows: " + where)
        # only an aggregate verdict reads the declaration (rule 2's bound does not): an element failure stays one
        if kind == "aggregate" and rules.points_only and judge_output(
                case, ex.output, exp.truth, emu, exp.precision, dataclasses.replace(rules, points_only=False),
                exp.before).ok:
            lines.append("  declaration: " + UNDECLARED_PASS)
    except Exception as e:  # noqa: BLE001 - the diagnosis is advice; its failure must not hide the verdict
        lines.append(f"  (no diagnosis: {type(e).__name__}: {e})")
    return lines, name, also


def _explain(spec, case, device, kind, message, verdict, ex: Execution, exp: Expectation, repro: str,
             notes=()) -> str:
    lines = [f"FAIL backend={spec.name} case={case.id} device={device} kind={kind}", f"  {message}"]
    if ex.failure is not None and ex.failure.traceback:
        lines.append("  " + ex.failure.traceback.strip().replace("\n", "\n  "))
    if verdict is not None and verdict.worst and not verdict.ok:
        coords = _op_coords(case, exp.inputs) if case.level == "op" else _expert_coords(case, exp.inputs)
        names = ("t", "j", "col") if case.level == "op" else ("t", "h")
        lines.append(format_worst(verdict, names, coords))
    lines.extend(notes)
    if ex.log.strip():
        lines.append("  backend output (last lines):\n    " + "\n    ".join(ex.log.strip().splitlines()[-15:]))
    lines.append(f"CASE: {case.to_json()}")
    lines.append(f"REPRO: {repro}")
    return "\n".join(lines)
