"""`moe-lora-harness`: check every registered backend (the matrix), replay one case, list, fuzz.

  moe-lora-harness check [--backend REF] [--only NAME] [--device D] [--more] [--budget 2m] [--jobs N|auto]
                         [--json F] [--markdown F]
  moe-lora-harness check --model NAME|--model-config PATH [--tp N] [--ep N] [--tokens LIST] [--only NAME]
  moe-lora-harness models [--sources]
  moe-lora-harness replay --case JSON|FILE|- [--only NAME] [--backend REF] [--device D] [--repeat N]
  moe-lora-harness fuzz --only NAME [--level op|expert|layer] [--budget 10m] [--max-examples N] [--out DIR]
                        [--junit F] [--palette auto|free|classes] [--jobs N]
  moe-lora-harness list [--backend REF] [--only NAME]
  moe-lora-harness selftest [--corpus op|tp|semantics|ep|fp8|reach|schedule|layer|production] [--detectors check,fuzz]
                            [--quick] [--budget 10m] [--jobs N|auto] [--junit F] [--json F] [--write-order PATH]
  moe-lora-harness adapter verify DIR [DIR...] --model-config PATH [--layers N] [--against DIR...]

Backends run in a supervised worker process: a backend that raises, exits, crashes or hangs (past
--timeout seconds per case) fails that case and the run goes on. A failing case is run --reruns more
times to tell a wrong backend from a nondeterministic one. REF is MODULE:ATTR or path/to/file.py:ATTR.
check and selftest --jobs N run N at once, one job process each, into one report (auto: 1 on the CPU, with --model
and with --in-process; else min(8, half the CPU cores)).
Exit codes: 0 all claimed cases pass, 1 a failure (or nothing was tested), 2 a usage error, 3 an error of
the harness itself (reports still written), 130 interrupted, 141 the output pipe closed (`| head`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import signal
import sys
import time

from moe_lora_harness.harness.draw.cache import fuzz_corpus_dir
from moe_lora_harness.harness.spec.contract import device_kind
from moe_lora_harness.harness.execution.device import DEVICE_FORMS, parse_device, prepare_device
from moe_lora_harness.harness.execution.job_pool import jobs_arg as _jobs_arg
from moe_lora_harness.harness.execution.worker import DEFAULT_TIMEOUT


class UsageError(Exception):
    """A bad command line: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, exit 2 (argparse's default prints the whole usage block)
        raise UsageError(message)


def _device_arg(text: str) -> str:
    try:
        return parse_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--device: ")) from None


def _positive(kind):
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive number; got {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number; got {text!r}")
        return v
    return parse


def _device(args) -> str:
    try:
        return prepare_device(args.device)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _backends(args):
    import dataclasses
    from moe_lora_harness.harness.spec.registry import BackendLoadError, available_backends, load_attr, select
    try:
        specs = select(available_backends(extra_refs=args.backend or []), args.only)
        setup = getattr(args, "setup", None)
        if setup:
            if not callable(load_attr(setup)):
                raise UsageError(f"--setup {setup!r} is not callable")
            specs = {n: (s if s.setup is not None else dataclasses.replace(s, setup=setup)) for n, s in specs.items()}
        return specs
    except BackendLoadError as e:
        raise UsageError(str(e)) from None


def _executor(args):
    from moe_lora_harness.harness.execution.worker import executor_for
    return executor_for(args.in_process, args.timeout)


def _write_reports(args, matrix, names, meta, title):
    from moe_lora_harness.harness.check.report import matrix_junit_cases, to_json, to_junit, to_markdown
    if args.json:
        pathlib.Path(args.json).write_text(to_json(matrix, meta))
    if args.markdown:
        pathlib.Path(args.markdown).write_text(to_markdown(matrix, names, title))
    if getattr(args, "junit", None):
        pathlib.Path(args.junit).write_text(to_junit("moe-lora-harness check", matrix_junit_cases(matrix)))


def _check_plan(args, device):
    """check's plan: (backends, cases per feature, row names, the --model plan or None, runs), each run (backend
    name, spec, row, case or layer scenario), in --budget's order when there is one."""
    from moe_lora_harness.harness.check.features import FEATURES, feature_cases
    specs = _backends(args)
    n = args.cases_per_feature or (6 if args.more else 2)
    levels = {lv for s in specs.values() for lv in s.capabilities.levels}   # rows only at levels a backend has
    features = [f for f in FEATURES if f.level in levels
                and (not args.feature or any(want in f.name for want in args.feature))]
    model = _model_plan(args, specs, device, features)    # --model / --model-config: harness.check.model_plan
    layer_rows = []
    if "layer" in levels and model is None:
        from moe_lora_harness.harness.layer.layer_scenarios import layer_scenarios
        layer_rows = [(label, sc) for label, sc in layer_scenarios(device)
                      if not args.feature or any(want in label for want in args.feature)]
    if not features and not layer_rows:
        raise UsageError(f"--feature {args.feature}: no feature name at the levels of these backends "
                         f"({', '.join(sorted(levels))}) contains it; features: "
                         f"{', '.join(f.name for f in FEATURES if f.level in levels)}")
    cases = feature_cases(features, device, n) if model is None else []
    plan = [(name, spec, feat.name, case) for name, spec in specs.items() for feat, _, case in cases
            if case.level in spec.capabilities.levels]   # a backend is asked only at the levels it has
    names = [f.name for f in features] + [label for label, _ in layer_rows]
    if model is not None:
        plan, names = model.runs, model.rows
    if layer_rows:   # the named layer scenarios, at a configuration each layer claims (harness.layer.layer_scenarios)
        from moe_lora_harness.harness.layer.layer_scenarios import claimed_scenario
        plan += [(name, spec, label, claimed_scenario(spec, sc, device)) for name, spec in specs.items()
                 if "layer" in spec.capabilities.levels for label, sc in layer_rows]
    if args.budget:     # the rows that kill the most planted bugs first (harness.check.check_order)
        from moe_lora_harness.harness.check.check_order import row_key, stored
        key = row_key(stored(device), names)
        plan = sorted(plan, key=lambda run: key(run[2]))
    return specs, n, names, model, plan


def _check_one(args, spec, case, device: str, executor):
    """One run of check's plan: a case (harness.execution.runner) or a layer scenario (harness.layer.layer_runner)."""
    if hasattr(case, "steps"):
        from moe_lora_harness.harness.layer.layer_runner import run_scenario
        return run_scenario(spec, case, device, executor=executor, probe=args.probe_unsupported)
    from moe_lora_harness.harness.execution.runner import run_case
    return run_case(spec, case, device, probe=args.probe_unsupported, executor=executor, reruns=args.reruns)


@dataclasses.dataclass
class _Ran:
    """What check's loop ran: (plan index, Outcome) in plan order, the indices --budget cut and those in flight
    when it stopped (a harness error's first), whether it was interrupted, a harness error, worker restarts."""

    outcomes: list = dataclasses.field(default_factory=list)
    unreached: list = dataclasses.field(default_factory=list)
    in_flight: list = dataclasses.field(default_factory=list)
    interrupted: bool = False
    harness_error: str | None = None
    restarts: int = 0


def _too_late(deadline, row_s: dict, feat: str) -> bool:
    """--budget: a run of row `feat` would end past the deadline (as long as that row's last run took)."""
    return deadline is not None and time.monotonic() + row_s.get(feat, 0.0) >= deadline


def _finished(args, ran: _Ran, row_s: dict, progress, i: int, feat: str, o, seconds: float) -> None:
    """One run of check's plan done: kept, its row timed, reported."""
    ran.outcomes.append((i, o))
    row_s[feat] = seconds
    progress.finished(o, seconds)
    if o.failed and args.verbose:
        print(o.detail, file=sys.stderr)


def _check_in_turn(args, device: str, plan: list, deadline, progress) -> _Ran:
    """`check --jobs 1`: the runs in plan order, in this process's executor."""
    ran, row_s = _Ran(), {}
    executor = _executor(args)
    try:
        for i, (name, spec, feat, case) in enumerate(plan):
            if _too_late(deadline, row_s, feat):
                ran.unreached = list(range(i, len(plan)))
                break
            ran.in_flight, t1 = [i], time.time()
            progress.start(name, feat)
            o = _check_one(args, spec, case, device, executor)
            _finished(args, ran, row_s, progress, i, feat, o, time.time() - t1)
        ran.in_flight = []
    except KeyboardInterrupt:
        ran.interrupted = True
    except Exception:  # noqa: BLE001 - a bug of ours: say so, and still write what was judged
        import traceback
        ran.harness_error = traceback.format_exc()
        ran.interrupted = True
    finally:
        executor.close()
        ran.restarts = getattr(executor, "restarts", 0)
    return ran


def _jobs_order(plan: list) -> list:
    """The plan's indices as `check --jobs` hands them out without --budget: the layer scenarios (the longest runs)
    first, and within each kind the backends taken in turn (each backend's first run, then each one's second, ...),
    so that jobs starting together on a cold cache compile different backends' kernels, not the same ones side by
    side (Triton has no lock across processes)."""
    seen: dict = {}
    turn = []
    for name, *_ in plan:
        turn.append(seen.get(name, 0))
        seen[name] = turn[-1] + 1
    return sorted(range(len(plan)), key=lambda i: (not hasattr(plan[i][3], "steps"), turn[i], i))


def _check_in_jobs(args, device: str, plan: list, jobs: int, deadline, progress) -> _Ran:
    """`check --jobs N`: the runs handed out to N job processes as they come free (harness.execution.job_pool), in
    `_jobs_order` unless --budget sets the order, its test made as each is handed out; the outcomes put back in
    plan order."""
    from moe_lora_harness.harness.execution.job_pool import serve
    ran, row_s, cut = _Ran(), {}, []

    def task(i):
        name, _, feat, case = plan[i]
        if _too_late(deadline, row_s, feat):
            cut.append(i)
            return None
        return name, case

    def finished(i, o, seconds):
        _finished(args, ran, row_s, progress, i, plan[i][2], o, seconds)
    # the options without the command's function: run as `python -m ...cli`, it is __main__'s, which a job lacks
    options = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "fn"})
    try:
        order = None if deadline is not None else _jobs_order(plan)
        served = serve("moe_lora_harness.harness.front.cli:check_job", (options, device), len(plan), jobs, task=task,
                       started=lambda i: progress.start(plan[i][0], plan[i][2]), finished=finished, order=order)
    except Exception:  # noqa: BLE001 - a bug of ours (the jobs are stopped): say so, and still write what was judged
        import traceback
        ran.harness_error, ran.interrupted = traceback.format_exc(), True
        served = None
    ran.outcomes.sort(key=lambda run: run[0])
    if served is not None:
        ran.unreached = served.not_handed if cut else []
        failed = [i for i, _ in served.errors if i is not None]
        ran.in_flight = failed + [i for i in served.in_flight if i not in failed]
        ran.interrupted = served.interrupted or bool(served.errors)
        if served.errors:
            ran.harness_error = "\n".join(text for _, text in served.errors)
        ran.restarts = sum((s or {}).get("restarts", 0) for s in served.stats)
    return ran


class _CheckJob:
    """One job of `check --jobs N` (harness.execution.job_pool): the command's backends and its own executor; runs
    (backend name, case or scenario) as the parent sends them."""

    def __init__(self, args, device: str):
        prepare_device(device)
        self.args, self.device = args, device
        self.specs = _backends(args)
        self.executor = _executor(args)

    def run(self, what):
        name, case = what
        return _check_one(self.args, self.specs[name], case, self.device, self.executor)

    def close(self) -> dict:
        self.executor.close()
        return {"restarts": getattr(self.executor, "restarts", 0)}


def check_job(options) -> _CheckJob:
    """job_pool's entry for check: options = (parsed args, device)."""
    return _CheckJob(*options)


def _judged_as_rounding_anywhere(specs: dict, outcomes: list, device) -> list:
    """The backends whose values this run judged without a model_points_only declaration for `device`."""
    judged = {o.backend for o in outcomes if o.judged}
    return [n for n, spec in specs.items() if n in judged and not spec.model_points_only_for(device)]


def _fp8_at_worst_case(specs: dict, outcomes: list, device) -> list:
    """The backends whose FP8 runs this run judged on a GPU with the worst-case accumulation term (no FP8
    accumulation declared there, BackendSpec.fp8_mma, or not one the judge models: expectation.modelled_mma). A run
    whose declarations raised (kind "declaration") was judged by no term, and its declaration is not asked again."""
    from moe_lora_harness.harness.judge.expectation import modelled_mma
    from moe_lora_harness.harness.spec.case import FP8_QUANTS
    if device_kind(device) != "cuda":
        return []
    return sorted({o.backend for o in outcomes if o.judged and o.kind != "declaration" and o.case.quant in FP8_QUANTS
                   and o.backend in specs and o.case.level == "expert"
                   and modelled_mma(specs[o.backend], o.case, device) is None})


def cmd_check(args) -> int:
    deadline = time.monotonic() + args.budget if args.budget else None    # --budget counts from here
    device = _device(args)
    from moe_lora_harness.harness.execution.job_pool import resolve_jobs
    from moe_lora_harness.harness.check.report import build_matrix, to_text
    from moe_lora_harness.harness.execution.runner import STATUSES
    specs, n, names, model, plan = _check_plan(args, device)
    jobs = resolve_jobs(args.jobs, device, heavy=model is not None, in_process=args.in_process)
    jobs = min(jobs, max(1, len(plan)))
    feature_of, outcomes = {}, []
    for feat, o in (model.prejudged if model is not None else []):   # cases too large for this machine
        feature_of[id(o)] = feat
        outcomes.append(o)
    specs, absent = _offered(specs, plan, outcomes)
    total = len(plan) + len(outcomes)
    t0 = time.time()
    previous_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    from moe_lora_harness.harness.check.check_progress import CheckProgress
    progress = CheckProgress(len(plan), _progress_wanted(args), jobs=jobs)
    try:
        ran = (_check_in_turn(args, device, plan, deadline, progress) if jobs == 1 else
               _check_in_jobs(args, device, plan, jobs, deadline, progress))
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        times = progress.close()
        if times:
            print(times, file=sys.stderr)
    for i, o in ran.outcomes:
        feature_of[id(o)] = plan[i][2]
        outcomes.append(o)
    unreached = [(plan[i][0], plan[i][2]) for i in ran.unreached]
    interrupted, harness_error, restarts = ran.interrupted, ran.harness_error, ran.restarts
    in_flight = [(plan[i][0], plan[i][2], plan[i][3]) for i in ran.in_flight]
    matrix = build_matrix(outcomes, lambda o: feature_of[id(o)])
    left = []
    if unreached:        # --budget spent: the cells not reached are marked so (and skipped in the JUnit)
        from moe_lora_harness.harness.check.report import add_not_reached
        left = add_not_reached(matrix, unreached)
        matrix = {b: matrix[b] for b in [*specs, *matrix] if b in matrix}
    failures = [o for o in outcomes if o.failed]
    if failures:   # grouped, and before the matrix, so that the matrix and the summary end the output
        from moe_lora_harness.harness.check.failure_groups import group_failures, groups_text
        print(groups_text(group_failures(failures, lambda o: feature_of[id(o)]), specs) + "\n")
    print(to_text(matrix, names))
    if left:
        from moe_lora_harness.harness.check.report import not_reached_text
        print("\n" + not_reached_text(left, args.budget, total))
    if model is not None:
        print("\n".join(model.notes()))
    for o in outcomes:
        if o.status == "works-unclaimed":
            print(f"NOTE {o.backend} works where it claims not to: {o.reason}: {o.case.to_json()}")
    if absent:
        print(f"\nnot in this run (no case of the selected features at their levels): {', '.join(absent)}")
    cut = {b for b, _ in unreached}       # a backend the budget did not reach is not said to be untested
    untested = [name for name in specs
                if not any(o.backend == name and o.judged for o in outcomes) and name not in cut]
    # a backend that declares this device not its own (Capabilities.device_reasons) is not a failure, as long as
    # something was tested; alone, it tested nothing
    elsewhere = [n for n in untested if device_kind(device) in specs[n].capabilities.device_reasons]
    if len(untested) < len(specs):
        untested = [n for n in untested if n not in elsewhere]
    if not interrupted:
        for name in elsewhere:
            print(f"\nNOT ON {device_kind(device).upper()}: {name}: "
                  f"{specs[name].capabilities.device_reasons[device_kind(device)]}")
        for name in untested:
            print(f"\nNOTHING TESTED: {name} declined every case it was offered on {device} (see its declared "
                  f"reasons above); a backend that claims nothing cannot pass")
        for name in _judged_as_rounding_anywhere(specs, outcomes, device):
            print(f"NOTE {name} is judged as a kernel that may round where its model does not (no "
                  f"model_points_only declared for {device_kind(device)}): rules 3 and 4 allow one more rounding of "
                  f"every value, at its worst-case tail; a kernel that rounds only at its model's points may declare "
                  f"it, for aggregate verdicts several times sharper (docs/error-model.md)")
        for name in _fp8_at_worst_case(specs, outcomes, device):
            print(f"NOTE {name}'s FP8 runs were judged with the worst-case accumulation term (its FP8 accumulation on "
                  f"this GPU is not declared, or not emulated for them: BackendSpec.fp8_mma): their aggregate verdicts "
                  f"pass slips up to about 10-36 times the kernel's own error; declaring it makes them several times "
                  f"sharper (docs/error-model.md, \"A declared e4m3 accumulation\")")
        passed = [o for o in outcomes if o.status == "pass"]
        unseen = sum(1 for o in passed if o.verdict is not None and o.verdict.unseen)
        if unseen:
            print(f"NOTE in {unseen} of {len(passed)} passing runs some rows were beyond rule 4 (too few: a decode "
                  f"call's, one expert's or one slot's; or FP8 activations, where it is off): a mistake confined to "
                  f"them is judged by rules 2 and 3 alone, which pass one up to about 2.8 times those rows' own error "
                  f"(each cell's 'rule4_unseen' in --json; docs/error-model.md, \"What the judge cannot see\")")
    counts = {s: sum(o.status == s for o in outcomes) for s in STATUSES}
    meta = {"device": device, "cases_per_feature": n, "seconds": round(time.time() - t0, 1),
            "backends": {s.name: {"description": s.description, "origin": s.origin} for s in specs.values()},
            "not_in_run": absent, "counts": counts, "planned_runs": total, "worker_restarts": restarts,
            "interrupted": bool(interrupted), "not_tested": untested if not interrupted else [], "jobs": jobs}
    if model is not None:
        meta["model"] = model.meta()
    if deadline is not None:
        meta.update(budget_s=args.budget, order="rows ranked by the planted bugs they kill (harness.check.check_order)",
                    not_reached_runs=len(unreached), not_reached=left)
    if harness_error:
        meta["harness_error"] = harness_error
    if interrupted:
        meta["not_run"] = total - len(outcomes)
        runs = [{"backend": b, "feature": f, "case": c.to_json()} for b, f, c in in_flight]
        if runs:
            meta["in_flight"] = runs[0]
        if len(runs) > 1:
            meta["in_flight_runs"] = runs     # --jobs N: every run in flight when it stopped
    title = (f"Conformance on {device} ({n} cases per feature)" if model is None else
             f"Conformance of {model.layer.name}'s layer on {device} ({meta['model']['layer']}; T in {model.tokens})")
    _write_reports(args, matrix, names, meta, title + "\n")
    summary = (f"\n{len(outcomes)} runs: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v)
               + f" in {time.time() - t0:.0f}s on {device}" + (f" ({jobs} jobs)" if jobs > 1 else "")
               + (f"; {restarts} worker restart(s)" if restarts else "")
               + (f"; {len(unreached)} not reached within --budget" if unreached else ""))
    print(summary)
    if harness_error:
        where = f"{in_flight[0][0]} / {in_flight[0][1]}: {in_flight[0][2].to_json()}" if in_flight else "the run"
        print(f"HARNESS ERROR (a bug of moe-lora-harness, not of the backend) while judging {where}\n"
              f"{harness_error}", file=sys.stderr)
        return 3
    if interrupted:
        where = "".join(f"; in flight: {b} / {f}: {c.to_json()}" for b, f, c in in_flight)
        print(f"INTERRUPTED: {total - len(outcomes)} of {total} planned runs not run{where}; "
              f"the partial matrix above" + (" and the reports were written" if (args.json or args.markdown) else ""))
        return 130
    return 1 if (failures or untested) else 0


def _offered(specs: dict, plan: list, outcomes: list) -> tuple[dict, list]:
    """(the backends offered a case of the selected features, the names of the others): a backend with no case at
    its levels is not part of the run, so it is neither in the matrix nor NOTHING TESTED. When none was offered
    anything, all stay, and each then tested nothing."""
    offered = {run[0] for run in plan} | {o.backend for o in outcomes}
    if not offered:
        return specs, []
    return {n: s for n, s in specs.items() if n in offered}, [n for n in specs if n not in offered]


def _model_plan(args, specs, device, features):
    """check --model NAME / --model-config PATH: every feature at that layer's shape (harness.check.model_plan), or None
    without them; a bad option is a usage error naming it."""
    if not (args.model or args.model_config):
        _no_served_layer(("--tp", args.tp), ("--ep", args.ep), ("--tokens", args.tokens), ("--adapter", args.adapter))
        return None
    from moe_lora_harness.harness.check.model_plan import DEFAULT_TOKENS, plan_model
    layer = _served_layer(args)
    if args.more or args.cases_per_feature:
        raise UsageError("--more / --cases-per-feature do not apply with --model: each feature runs at every --tokens "
                         "count in every dtype of the device's profile")
    if not features:
        raise UsageError("no op- or expert-level feature for these backends" + (f" contains {args.feature}" if
                                                                                args.feature else ""))
    adapters = None
    if args.adapter:
        if (args.tp or 1) > 1:
            raise UsageError("--adapter with --tp: the adapter files hold the whole layer; a TP slice of them is not "
                             "modelled in model mode (run --tp 1, or --ep)")
        from moe_lora_harness.harness.check.model_plan import adapter_fields
        from moe_lora_harness.harness.served.peft_adapters import AdapterFileError
        try:
            adapters = adapter_fields(layer, [os.path.abspath(p) for p in args.adapter], args.adapter_layer)
        except (AdapterFileError, ValueError, OSError) as e:
            raise UsageError(f"--adapter: {e}") from None
    try:
        return plan_model(layer, specs, device, features, tp=args.tp or 1, ep=args.ep or 1,
                          tokens=args.tokens or DEFAULT_TOKENS, adapters=adapters)
    except ValueError as e:   # a TP / EP degree the layer does not divide by
        raise UsageError(str(e)) from None


def _no_served_layer(*given) -> None:
    """Without --model / --model-config: a usage error for the first of `given` (option, value) that was set."""
    for opt, v in given:
        if v:
            raise UsageError(f"{opt} needs --model or --model-config (a served layer's shape)")


def _served_layer(args):
    """The layer --model names or --model-config describes; a usage error naming the option where it cannot be
    read (both given is one too)."""
    if args.model and args.model_config:
        raise UsageError("give one of --model (a catalogue name) and --model-config (a config.json), not both")
    from moe_lora_harness.harness.served.models import ConfigError, layer_from_config, model_named
    try:
        return model_named(args.model) if args.model else layer_from_config(args.model_config)
    except ConfigError as e:
        raise UsageError(f"--model-config: {e}") from None
    except ValueError as e:
        raise UsageError(str(e)) from None


def _rank_list(text: str) -> tuple:
    """--rank: comma-separated LoRA ranks, each a positive int."""
    why = f"--rank must be comma-separated positive integers, e.g. 16,32,64; got {text!r}"
    try:
        ranks = tuple(int(r) for r in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(why) from None
    if any(r < 1 for r in ranks):
        raise argparse.ArgumentTypeError(why)
    return ranks


def _token_list(text: str) -> tuple:
    """--tokens: comma-separated token counts, each an int >= 0 or a sum like 4096+17."""
    try:
        counts = tuple(sum(int(p) for p in item.split("+")) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts (e.g. 1,7,64,4096+17); "
                                         f"got {text!r}") from None
    if not counts or any(c < 0 for c in counts):
        raise argparse.ArgumentTypeError(f"token counts must be >= 0; got {text!r}")
    return counts


def cmd_models(args) -> int:
    """The catalogue of served MoE layers (harness.served.models), one line each; --sources: where each number came from."""
    from moe_lora_harness.harness.served.models import MODELS
    head = ("model", "H", "I", "E", "top_k", "activation", "routing", "shared", "quant", "TP", "EP")
    rows = [(m.name, m.H, m.I, m.E, m.top_k, m.activation + (" +bias" if m.bias else ""), m.routing_text(),
             f"{m.shared_experts} x I={m.shared_I // max(1, m.shared_experts)}" if m.shared_experts else "-",
             m.quant, ",".join(map(str, m.tp_degrees())), ",".join(map(str, m.ep_degrees()))) for m in MODELS]
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(f"{str(v):<{w}}" for v, w in zip(r, widths)).rstrip())
    print("\nTP / EP: the degrees (of 1..16 / 1..64) at which I / tp and E / ep are whole; "
          "`check --model NAME --tp N --ep N` runs one rank's slice")
    if args.sources:
        for m in MODELS:
            print(f"\n{m.name}: {m.config_url}\n  read in: {m.read_in}" + (f"\n  note: {m.note}" if m.note else ""))
            for fld, src in m.sources:
                print(f"  {fld} = {getattr(m, fld)!r}: {src}")
            for fld in m.unsourced:
                print(f"  {fld} = {getattr(m, fld)!r}: NO SOURCE FOUND")
    return 0


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _read_json_arg(arg: str, option: str, label: str, parse):
    """`option`'s value: the JSON itself (as printed after `label`:), a file holding it, or '-' for stdin ->
    parse(text), well-formed (its `problems()` empty), or a UsageError naming the option."""
    text = sys.stdin.read() if arg == "-" else arg
    if arg != "-" and not arg.lstrip().startswith("{"):
        path = pathlib.Path(arg)
        if not path.is_file():
            raise UsageError(f"{option}: expected the JSON printed after {label}:, a file holding it, or '-'; "
                             f"got {arg[:80]!r}, which is neither JSON nor an existing file")
        text = path.read_text()
    try:
        obj = parse(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{option}: not valid JSON ({e})") from None
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{option}: {e}") from None
    problems = obj.problems()
    if problems:
        raise UsageError(f"{option}: malformed {label.lower()}: {'; '.join(problems)}")
    return obj


def _is_failure_record(d) -> bool:
    """Whether a JSON object is a failure file that fuzz writes (failure-NN.json: harness.search.fuzz_report)."""
    return isinstance(d, dict) and "signature" in d and "case" in d and "repro" in d


def _part(text: str, key: str):
    """The JSON of a --case / --scenario: a failure file's `key` part (it replays as it is), else the whole."""
    d = json.loads(text)
    if _is_failure_record(d):
        if key not in d:
            raise ValueError(f"this fuzz failure file holds no {key} (it holds: {', '.join(sorted(d))})")
        return d[key]
    return d


def _layer_failure_file(arg: str) -> bool:
    """Whether `arg` names a layer failure file (its scenario is what replays, whichever option named it)."""
    path = pathlib.Path(arg)
    if arg == "-" or arg.lstrip().startswith("{") or not path.is_file():
        return False
    try:
        d = json.loads(path.read_text())
    except (ValueError, OSError):
        return False
    return _is_failure_record(d) and "scenario" in d


def read_case_arg(arg: str):
    """--case: an op or expert case (harness.spec.case.Case), or a fuzz failure file holding one."""
    from moe_lora_harness.harness.spec.case import Case
    return _read_json_arg(arg, "--case", "CASE", lambda text: Case.from_json(_part(text, "case")))


def read_scenario_arg(arg: str):
    """--scenario: a layer scenario (harness.build.layer_scenario.Scenario), or a layer fuzz failure file holding one."""
    from moe_lora_harness.harness.build.layer_scenario import Scenario
    return _read_json_arg(arg, "--scenario", "SCENARIO", lambda text: Scenario.from_json(_part(text, "scenario")))


def cmd_replay(args) -> int:
    if (args.case is None) == (args.scenario is None):
        raise UsageError("replay needs exactly one of --case (an op or expert case) and --scenario (a layer scenario)")
    if args.case is not None and _layer_failure_file(args.case):    # fuzz --level layer's failure-NN.json
        args.case, args.scenario = None, args.case
    case = read_case_arg(args.case) if args.case is not None else read_scenario_arg(args.scenario)
    device = _device(args)
    from moe_lora_harness.harness.execution.runner import run_case
    from moe_lora_harness.harness.layer.layer_runner import run_scenario
    specs = _backends(args)
    rc = 0
    executor = _executor(args)

    def run(spec):
        if args.scenario is not None:
            return run_scenario(spec, case, device, executor=executor, probe=True)
        return run_case(spec, case, device, probe=True, executor=executor, reruns=0)
    try:
        for name, spec in specs.items():
            runs = [run(spec) for _ in range(args.repeat)]
            seen = [o.status + (f" ({o.kind})" if o.kind else "") for o in runs]
            if len(set(seen)) > 1:
                print(f"{name}: NONDETERMINISTIC over {args.repeat} runs: " + ", ".join(seen))
                for o in runs:
                    if o.failed:
                        print(o.detail)
                        break
                rc = 1
                continue
            o = runs[0]
            v = o.verdict.summary() if o.verdict else ""
            times = f" (same outcome in all {args.repeat} runs)" if args.repeat > 1 else ""
            print(f"{name}: {o.status} {o.reason} {v}".rstrip() + times)
            if o.failed:
                print(o.detail)
                rc = 1
    except KeyboardInterrupt:
        print("INTERRUPTED", file=sys.stderr)
        return 130
    finally:
        executor.close()
    return rc


def cmd_list(args) -> int:
    prepare_device(None)
    for name, spec in _backends(args).items():
        cap = spec.capabilities
        entry = [lv for lv, fn in (("op", spec.op), ("expert", spec.experts)) if fn is not None]
        print(f"{name}: {spec.description}\n    levels={sorted(cap.levels)} entry points={entry} "
              f"devices={sorted(cap.devices)} layouts={sorted(cap.layouts)} max_rank={cap.max_rank} "
              f"origin={spec.origin}")
        for (dev, dt), why in sorted(cap.dtype_reasons.items()):
            print(f"    no {dt} on {dev}: {why}")
        for (axis, value), why in sorted(cap.reasons.items()):
            print(f"    no {axis} {value}: {why}")
        for dev, why in sorted(cap.device_reasons.items()):
            print(f"    not on {dev}: {why}")
        for r in cap.rules:
            print(f"    rule {r.name}: {r.reason}")
        for b in spec.known_bugs:
            print(f"    known bug {b.issue}: {b.description}")
    return 0


def fuzz_level(spec, asked: str | None) -> str:
    """The level to fuzz: the one the backend provides, or the one asked for (which it must provide)."""
    provided = [lv for lv, fn in (("op", spec.op), ("expert", spec.experts), ("layer", spec.layer))
                if fn is not None and lv in spec.capabilities.levels]
    if not provided:
        raise UsageError(f"{spec.name} provides no entry point to fuzz (levels {sorted(spec.capabilities.levels)})")
    if asked is None:
        if len(provided) > 1:
            raise UsageError(f"{spec.name} provides the {', '.join(provided)} levels: pass --level "
                             + " or --level ".join(provided))
        return provided[0]
    if asked not in provided:
        raise UsageError(f"{spec.name} provides no {asked}-level entry point (it provides: {', '.join(provided)})")
    return asked


def parse_budget(text: str) -> float:
    """'90s', '10m', '1h', '1h30m' or plain seconds -> seconds."""
    t = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", t):
        t += "s"
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", t)
    if not parts or "".join(n + u for n, u in parts) != t:
        raise argparse.ArgumentTypeError(f"expected a duration like 90s, 10m, 1h30m or seconds; got {text!r}")
    seconds = sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive duration like 90s, 10m or 1h30m; got {text!r}")
    return seconds


def _progress_wanted(args) -> bool:
    return not args.quiet and sys.stderr.isatty() and not os.environ.get("CI")


def cmd_fuzz(args) -> int:
    """A campaign against one backend: every distinct failure within the budget, each shrunk, with its repro."""
    device = _device(args)
    from moe_lora_harness.harness.search.campaign import Campaign
    from moe_lora_harness.harness.draw.compile_classes import palette_of
    from moe_lora_harness.harness.search.fuzz_report import print_report, write_reports
    from moe_lora_harness.harness.draw.profiles import draw_sizes
    from moe_lora_harness.harness.draw.strategies import claimed_cases, profile, wants_compile_classes
    specs = _backends(args)
    if len(specs) != 1:
        raise UsageError(f"fuzz one backend at a time (--only NAME); have {sorted(specs)}")
    (name, spec), = specs.items()
    level = fuzz_level(spec, args.level)
    if level == "layer":
        return fuzz_layer(args, spec, device)
    sizes = draw_sizes(device, level)
    served = args.model or args.model_config
    if not served:
        _no_served_layer(("--tp", args.tp), ("--ep", args.ep), ("--tokens", args.tokens))
    # the search spends itself on what it claims (shapes from compile classes on a GPU unless --palette free; a
    # served layer's own shape with --model)
    classes = wants_compile_classes(args.palette, device) and not served
    strategy = claimed_cases(spec, device, level, compile_classes=classes, **sizes)
    shapes = "free shapes"
    if served:
        from moe_lora_harness.harness.search.model_fuzz import FUZZ_TOKENS, jobs_that_fit, served_cases
        from moe_lora_harness.harness.check.model_plan import shape_text
        layer = _served_layer(args)
        tokens = args.tokens or FUZZ_TOKENS
        try:
            if args.job_index is None:     # the campaigns the device holds at this shape (a job's share of memory)
                fit, why = jobs_that_fit(strategy, layer, spec, device, args.jobs, tp=args.tp or 1, ep=args.ep or 1,
                                         tokens=tokens)
                if why:
                    print(f"[fuzz] {why}", file=sys.stderr)
                    args.jobs = fit
            strategy = served_cases(strategy, layer, spec, device, tp=args.tp or 1, ep=args.ep or 1,
                                    tokens=tokens, share=args.job_count or args.jobs)
            shapes = (f"{layer.name}'s layer, {shape_text(layer, args.tp or 1, args.ep or 1)}, tokens "
                      f"{', '.join(map(str, tokens))}")
        except ValueError as e:    # a TP / EP degree the layer does not divide by; a layer the device cannot hold
            raise UsageError(str(e)) from None
    elif classes:
        pal = palette_of(spec, device, level, **sizes)
        shapes = f"{len(pal.classes)} compile classes ({len(pal.unmet)} value pairs it cannot claim)"
    if not args.quiet and args.job_index is None:
        print(f"[fuzz] {name}, {level} level on {device}: {shapes}", file=sys.stderr)
    if args.jobs > 1 and args.job_index is None:
        from moe_lora_harness.harness.search.fuzz_jobs import run_jobs
        return run_jobs(args.argv, args.jobs, args.out, args.junit, name, level, device, args.quiet)
    seed = args.seed
    if args.job_index is not None:     # one job of --jobs N: its own seed; the parent writes the JUnit
        from moe_lora_harness.harness.search.fuzz_jobs import SEED_STRIDE
        seed = None if seed is None else seed + args.job_index * SEED_STRIDE
        args.junit, args.quiet = None, True
    max_examples = args.max_examples or (10**9 if args.budget else 300)
    corpus = None if args.no_db else (args.corpus or str(fuzz_corpus_dir(name, spec.origin, level)))
    executor = _executor(args)
    campaign = Campaign(spec, device, level, executor, budget_s=args.budget, max_examples=max_examples,
                        seed=seed, reruns=args.reruns, database=None if args.no_db else profile("fuzz").database,
                        corpus_dir=corpus, sizes=sizes, progress=_progress_wanted(args))
    interrupted = False
    try:
        result = campaign.run(strategy)
    except KeyboardInterrupt:
        interrupted = True
        result = campaign.result
    finally:
        executor.close()
    records = [f.record() for f in result.found]
    fixed = [c.to_json() for c in result.fixed]
    summary = {"backend": name, "origin": spec.origin, "level": level, "device": device,
               "examples": result.examples, "seconds": round(result.seconds, 1), "stopped": result.exhausted,
               "interrupted": interrupted, "shapes": shapes, "claimed": result.claimed_any,
               "fixed_since_last_run": fixed}
    write_reports(records, summary, args.out, args.junit, name=name, level=level, seconds=result.seconds,
                  claimed=result.claimed_any)
    print_report(records, fixed, name=name, level=level, device=device, examples=result.examples,
                 seconds=result.seconds, stopped="interrupted" if interrupted else result.exhausted, out=args.out)
    if interrupted:
        return 130
    if not result.claimed_any and not result.found:
        print(f"{name}: NOTHING TESTED: no drawn {level}-level case is claimed by its declarations on {device}")
        return 1
    return 1 if result.found else 0


def fuzz_layer(args, spec, device: str) -> int:
    """A layer-level campaign: the state machine of harness.layer.layer_machine at the device's layer configuration in
    every dtype the layer claims (one --budget for all), every distinct failure shrunk to a scenario with its REPRO."""
    import dataclasses

    from moe_lora_harness.harness.search.fuzz_report import FailureRecord, print_report, write_reports
    from moe_lora_harness.harness.layer.layer_machine import fuzz_configs, search_layers
    from moe_lora_harness.harness.search.signatures import Signature, failure_class
    configs = fuzz_configs(spec, device)
    config = configs[0] if configs else None
    name = spec.name
    if not args.quiet:
        print(f"[fuzz] {name}, layer level on {device}: " + (f"{', '.join(c.dtype for c in configs)}, H={config.H} "
              f"I={config.I} E={config.E} top_k={config.top_k}, {config.max_loras} slots, max_tokens "
              f"{config.max_tokens}" if config else "no layer configuration it claims"), file=sys.stderr)
    records, examples, seconds, stopped = [], 0, 0.0, "nothing claimed"
    executor = _executor(args)
    interrupted = False
    try:
        if configs:
            result = search_layers(spec, configs, device, executor=executor, budget_s=args.budget,
                                   max_examples=args.max_examples or (10**9 if args.budget else 100), seed=args.seed,
                                   derandomize=args.seed is None and os.environ.get("MOE_LORA_HARNESS_PROFILE") == "ci")
            examples, seconds, stopped = result.examples, result.seconds, result.exhausted
            for o in result.found:
                m = re.match(r"step \d+ \((\w+)\)", o.message)
                step = m.group(1) if m else ""
                sig = Signature(failure_class(o), (("failing step", step),) if step else ())
                scenario = next((ln[len("SCENARIO: "):] for ln in o.detail.splitlines() if ln.startswith("SCENARIO: ")), "")
                records.append(FailureRecord(sig, o.case, o.kind, o.status, o.seconds, repro=o.repro,
                                             detail=o.detail, scenario=scenario))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        executor.close()
    summary = {"backend": name, "origin": spec.origin, "level": "layer", "device": device, "examples": examples,
               "seconds": round(seconds, 1), "stopped": stopped, "interrupted": interrupted,
               "configs": [dataclasses.asdict(c) for c in configs], "claimed": bool(configs)}
    write_reports(records, summary, args.out, args.junit, name=name, level="layer", seconds=seconds,
                  claimed=bool(configs))
    print_report(records, [], name=name, level="layer", device=device, examples=examples, seconds=seconds,
                 stopped="interrupted" if interrupted else stopped, out=args.out)
    if interrupted:
        return 130
    if not configs:
        print(f"{name}: NOTHING TESTED: it claims no layer configuration on {device}")
        return 1
    return 1 if records else 0


def cmd_selftest(args) -> int:
    """Every planted-bug corpus through check and a short fuzz; the kill matrix; fails if a mutant survives."""
    device = _device(args)
    if args.power:
        return _power(args, device)
    from moe_lora_harness.harness.check.report import to_junit
    from moe_lora_harness.harness.execution.job_pool import resolve_jobs
    from moe_lora_harness.harness.selftest.selftest import (CORPORA, SelftestResult, junit_cases, kill_matrix_text, run_selftest,
                                                   run_selftest_jobs)
    from moe_lora_harness.harness.selftest.selftest_progress import SelftestProgress
    known = [c.name for c in CORPORA]
    for name in args.corpus:
        if name not in known:
            raise UsageError(f"--corpus {name!r}: no such corpus; corpora: {', '.join(known)}")
    detectors = tuple(d for d in args.detectors.split(",") if d)
    bad = [d for d in detectors if d not in ("check", "fuzz")]
    if bad or not detectors:
        raise UsageError(f"--detectors must be a comma-separated subset of check,fuzz; got {args.detectors!r}")
    if args.write_order and "check" not in detectors:
        raise UsageError("--write-order needs the check detector (--detectors check)")
    budget = args.fuzz_budget if args.fuzz_budget is not None else (5.0 if args.quick else 20.0)
    examples = 120 if args.quick else 200     # the tp corpus needs 20-50 draws (fully-sharded cases)
    jobs = resolve_jobs(args.jobs, device, in_process=args.in_process)
    executor = _executor(args) if jobs == 1 else None      # --jobs N: each job has its own
    t0 = time.time()
    res = SelftestResult()          # filled as it goes: a Ctrl-C keeps what finished
    progress = SelftestProgress(live=_progress_wanted(args), verbose=args.verbose, jobs=jobs)
    previous_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    run = dict(corpora=args.corpus or None, detectors=detectors, fuzz_budget_s=budget, fuzz_max_examples=examples,
               palette=args.palette, progress=progress, result=res, all_rows=bool(args.write_order),
               deadline=time.monotonic() + args.budget if args.budget else None)
    try:
        if executor is not None:
            run_selftest(device, executor, **run)
        else:
            run_selftest_jobs(device, jobs, in_process=args.in_process, timeout=args.timeout, **run)
    except KeyboardInterrupt:
        res.stopped = "interrupted"
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        if executor is not None:
            executor.close()
        progress.close()
    print(kill_matrix_text(res, detectors))
    if args.junit:
        pathlib.Path(args.junit).write_text(to_junit("moe-lora-harness selftest", junit_cases(res)))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({
            "device": device, "detectors": detectors, "fuzz_budget_s": budget, "seconds": round(time.time() - t0, 1),
            "budget_s": args.budget, "partial": bool(res.stopped), "stopped": res.stopped or None,
            "not_reached": ["/".join(k) for k in res.not_reached], "in_flight": "/".join(res.in_flight or ()) or None,
            "in_flight_all": ["/".join(k) for k in res.running], "jobs": jobs, "harness_error": res.error or None,
            "mutants": {f"{c}/{b}": {d: vars(k) for d, k in cells.items()} for (c, b), cells in res.cells.items()},
            "controls": {f"{c}/{b}": fails for (c, b), fails in res.controls.items()},
            "skipped": res.skipped, "survivors": [f"{c}/{b}" for c, b in res.survivors],
            "misnamed": [f"{c}/{b}/{d}" for c, b, d in res.misnamed]}, indent=1, sort_keys=True))
    if args.write_order:
        _write_order(args.write_order, device, res)
    n = len(res.cells)
    print(f"\n{n} mutants, {n - len(res.survivors)} killed, {len(res.survivors)} survived; "
          f"{len(res.controls) - len(res.failing_controls)} of {len(res.controls)} controls pass; "
          f"{time.time() - t0:.0f}s on {device}")
    for c, b in res.survivors:
        print(f"SURVIVED: {c}/{b}: no detector caught this planted bug")
    for c, b, d in res.misnamed:
        k = res.cells[(c, b)][d]
        print(f"MISNAMED: {c}/{b} by {d}: commits {k.expected}, named {k.named or 'nothing'}")
    for c, b in res.failing_controls:
        print(f"CONTROL FAILED: {c}/{b}: {'; '.join(res.controls[(c, b)])}")
    if res.stopped:      # partial: what finished is above; what did not is no pass
        why = {"interrupted": "interrupted", "error": "a harness error"}.get(res.stopped)
        print(f"PARTIAL: {len(res.not_reached)} of {len(res.planned)} mutants and controls not finished "
              f"({why or f'--budget {args.budget:g}s spent'})")
        if res.error:
            print(f"HARNESS ERROR (a bug of moe-lora-harness, not of a planted bug) in a job running "
                  f"{'/'.join(res.in_flight or ('?',))}:\n{res.error}", file=sys.stderr)
            return 3
        return 130 if res.stopped == "interrupted" else 1
    if not n and not res.controls:
        print("NOTHING TESTED: no corpus ran here")
        return 1
    return 1 if (res.survivors or res.failing_controls or res.misnamed) else 0


def _write_order(path: str, device: str, res) -> None:
    """selftest --write-order: every check row's kills of the mutants that finished, merged into PATH's section
    for this device kind (harness.check.check_order: check --budget's order)."""
    from moe_lora_harness.harness.check.check_order import write_data
    kills = {f"{c}/{b}": list(cells["check"].rows) for (c, b), cells in res.cells.items()
             if "check" in cells and not cells["check"].error}
    data = write_data(path, device, kills, res.check_rows, ["/".join(k) for k in res.planned])
    print(f"\n--write-order {path}: {len(kills)} mutants over {len(res.check_rows)} rows; {len(data['order'])} rows "
          f"kill one, the first {len(set(data['first_killer'].values()))} in the order kill every planted bug "
          f"that a row kills; no check row kills {len(data['no_check_killer'])}")


def _power(args, device: str) -> int:
    """`selftest --power`: the judge's power table (harness.selftest.power); fails if the correct kernel fails, or if an
    output that assert_close fails passes the judge."""
    from moe_lora_harness.harness.selftest import power
    from moe_lora_harness.harness.served.models import model_named
    try:
        layers = [model_named(m) for m in args.model]
    except ValueError as e:
        raise UsageError(str(e)) from None
    name = args.only[0] if args.only else ("eager" if device != "cuda" else
                                            "triton_one_shot" if args.level == "op" else "triton_experts")
    if not args.only:
        args.only = [name]
    specs = _backends(args)
    if name not in specs:
        raise UsageError(f"--only {name!r}: no such backend")
    op = args.level == "op"
    if op and (args.quant != "none" or args.calls > 1 or args.tp > 1):
        raise UsageError("--level op: one fused_moe_lora call of unquantized weights (no --quant, --calls or --tp)")
    cases = power.power_cases(device, layers=layers, tokens=args.tokens or (),
                              dtypes=tuple(d for d in (args.dtype or "").split(",") if d), ranks=args.rank,
                              quant=args.quant, calls=args.calls, level=args.level, tp=args.tp)
    problems = next((p for p in (c.problems() for c in cases) if p), None)
    if problems:
        raise UsageError(f"--power's case (--quant {args.quant!r}, --calls {args.calls}, --tp {args.tp}): "
                         f"{problems[0]}")
    reports = []
    if not args.quiet:    # a table can take minutes per case (the Triton interpreter: hours): say so before it starts
        print(f"[power] {len(cases)} case(s) of {name} on {device}, "
              f"{len(power.OP_SLIPS if op else power.SLIPS)} slip classes each, every slip "
              f"bisected over up to {power.BISECTION_STEPS} sizes; a table prints after each case"
              + ("" if args.verbose else " (-v: a line per slip)"), file=sys.stderr, flush=True)
    for case in cases:
        reports.append(power.measure(specs[name], case, device,
                                     progress=(lambda w: print(f"[power] {w}", file=sys.stderr)) if args.verbose
                                     else None))
        print(power.power_table(reports[-1:]), flush=True)
        if args.json:     # after every case: a run cut by its time limit keeps what it measured
            pathlib.Path(args.json).write_text(json.dumps(power.to_json(reports), indent=1))
    # (oracle_only is 0 where assert_close fails the correct kernel: it cannot stand beside the judge there)
    bad = [r for r in reports if not r.kernel_ok or any(s.oracle_only for s in r.slips)
           or any(p.oracle_fails and not p.judge_fails for p in r.precision_slips)]
    for r in bad:
        missed = [s for s in r.slips if s.oracle_only]
        where = ("" if not missed else " (" + "; ".join(
            f"{s.slip}: {s.oracle_only}, " + ("within the judge's declared limit"
                                              if power.within_declared_limit(s, r)
                                              else "beyond its declared limits") for s in missed) + ")")
        print(f"POWER FAILED: {r.case.to_json()}: " + ("the correct kernel fails the judge" if not r.kernel_ok else
                                                       "an output assert_close fails passes the judge" + where))
    return 1 if bad else 0


def _corpora():
    from moe_lora_harness.harness.selftest.selftest import CORPORA
    return CORPORA


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="moe-lora-harness", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    def palette_option(sp):
        from moe_lora_harness.harness.draw.strategies import PALETTE_CHOICES
        sp.add_argument("--palette", choices=PALETTE_CHOICES, default="auto",
                        help="shapes: free (any size), classes (a pairwise palette of compile classes, so the Triton "
                             "cache is reused), auto (classes on a GPU, free on CPU; the default)")

    def common(sp, run=True):
        sp.add_argument("--backend", action="append", default=[], metavar="REF",
                        help="add a backend: MODULE:ATTR or path/to/file.py:ATTR naming a BackendSpec, a list of "
                             "them, or a fused_moe_lora-signature function")
        sp.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="restrict to these backends (short name, or the REF they came from)")
        if not run:
            return
        sp.add_argument("--device", type=_device_arg, default=None, metavar="DEVICE",
                        help=f"{DEVICE_FORMS} (default: cuda when available)")
        sp.add_argument("--timeout", type=_positive(float), default=DEFAULT_TIMEOUT, metavar="SECONDS",
                        help=f"per backend call in the supervised worker (default {DEFAULT_TIMEOUT:g})")
        sp.add_argument("--reruns", type=int, default=2, metavar="N",
                        help="run a failing case N more times; a changed outcome is reported as nondeterministic")
        sp.add_argument("--in-process", action="store_true",
                        help="call backends in this process (for a debugger; a crash or hang then ends the run)")
        sp.add_argument("--setup", metavar="REF", default=None,
                        help="MODULE:ATTR of a function run once per worker before a backend's first call (e.g. a "
                             "single-rank process group), for backends that declare no setup of their own")

    c = sub.add_parser("check", help="run the conformance features of every backend; print the matrix")
    common(c)
    c.add_argument("--cases-per-feature", type=_positive(int), default=None, metavar="N")
    c.add_argument("--more", action="store_true", help="6 cases per feature instead of 2")
    c.add_argument("--feature", action="append", default=[], metavar="TEXT",
                   help="only the features whose name contains TEXT (repeatable)")
    c.add_argument("--probe-unsupported", action="store_true",
                   help="also run declined cases and report those that pass")
    c.add_argument("--budget", type=parse_budget, default=None, metavar="DURATION",
                   help="a gate: run the rows that kill the most planted bugs first (selftest's kill data, "
                        "harness/check/check_order_data.py) and start no run that would end past DURATION (90s, 2m), by "
                        "its row's previous run; the rows not reached are listed, and skipped in the JUnit")
    c.add_argument("--jobs", type=_jobs_arg, default="auto", metavar="N",
                   help="N runs at once, one job process each, handed out in plan order as jobs come free, merged "
                        "into one report (the same as --jobs 1's); auto (the default): 1 on the CPU, with --model / "
                        "--model-config and with --in-process, else min(8, half the CPU cores)")
    c.add_argument("--json", metavar="PATH", help="write the matrix as JSON (also on a failure or Ctrl-C)")
    c.add_argument("--markdown", metavar="PATH", help="write the matrix as Markdown (also on a failure or Ctrl-C)")
    c.add_argument("--junit", metavar="PATH", help="write JUnit XML, one test case per feature x backend")
    c.add_argument("-v", "--verbose", action="store_true")
    c.add_argument("-q", "--quiet", action="store_true", help="no live progress line (off anyway when not a "
                                                              "terminal, or when $CI is set)")
    c.add_argument("--model", metavar="NAME", default=None,
                   help="run every feature at this served layer's shape (`moe-lora-harness models` lists them)")
    c.add_argument("--model-config", metavar="PATH", default=None,
                   help="the same for the MoE layer of a config.json (a file, or a folder holding one)")
    c.add_argument("--tp", type=_positive(int), default=None, metavar="N",
                   help="with --model: one TP rank's slice (I / N)")
    c.add_argument("--ep", type=_positive(int), default=None, metavar="N",
                   help="with --model: EP over N ranks (E / N local experts on the last rank, via the expert_map)")
    c.add_argument("--tokens", type=_token_list, default=None, metavar="LIST",
                   help="with --model: token counts (default 1,7,64,4096+17,16384)")
    c.add_argument("--adapter", action="append", default=[], metavar="DIR",
                   help="with --model: a PEFT adapter folder loaded into the next slot instead of a random adapter "
                        "(repeatable; each keeps its own rank and alpha)")
    c.add_argument("--adapter-layer", type=int, default=0, metavar="N",
                   help="with --adapter: the decoder layer whose expert factors are used (default 0)")
    c.set_defaults(fn=cmd_check)
    m = sub.add_parser("models", help="list the catalogue of served MoE layers (shapes, routing, quant, TP/EP)")
    m.add_argument("--sources", action="store_true", help="also where every number came from")
    m.set_defaults(fn=cmd_models)
    r = sub.add_parser("replay", help="replay one case (JSON) against the backends")
    common(r)
    r.add_argument("--case", default=None,
                   help="the case JSON printed by a failure (after CASE:), a file holding it (fuzz's failure-NN.json "
                        "too), or - for stdin")
    r.add_argument("--scenario", default=None,
                   help="a layer scenario's JSON (printed after SCENARIO:), a file holding it, or - for stdin")
    r.add_argument("--repeat", type=_positive(int), default=3, metavar="N",
                   help="run the case N times (default 3); differing outcomes are reported as nondeterministic")
    r.set_defaults(fn=cmd_replay)
    l_ = sub.add_parser("list", help="list backends and their declared capabilities")
    common(l_, run=False)
    l_.set_defaults(fn=cmd_list)
    f = sub.add_parser("fuzz", help="search for the smallest failing case of one backend")
    common(f)
    f.add_argument("--budget", type=parse_budget, default=None, metavar="DURATION",
                   help="time budget (90s, 10m, 1h); the campaign finds every distinct failure it can within it")
    f.add_argument("--max-examples", type=_positive(int), default=None, metavar="N",
                   help="at most N examples (default 300 without --budget, unbounded with it)")
    f.add_argument("--out", metavar="DIR", help="write each distinct failure (minimal case, signature, REPRO) "
                                                "as DIR/failure-NN.json and DIR/campaign.json")
    f.add_argument("--corpus", metavar="DIR", help="failures found before, replayed first (default "
                                                   "~/.cache/moe-lora-harness/corpus/NAME-LEVEL-DIGEST, DIGEST "
                                                   "of where the backend came from, or under "
                                                   "$MOE_LORA_HARNESS_CACHE; --no-db disables it)")
    f.add_argument("--junit", metavar="PATH", help="write JUnit XML (one test case per distinct failure)")
    f.add_argument("-q", "--quiet", action="store_true", help="no live progress line (off anyway when not a "
                                                              "terminal, or when $CI is set)")
    f.add_argument("--level", choices=("op", "expert", "layer"), default=None,
                   help="attack the op (fused_moe_lora) or an expert backend's forward (default: the level the "
                        "backend provides)")
    f.add_argument("--seed", type=int, default=None, help="fix hypothesis' random seed (reproducible search)")
    f.add_argument("--no-db", action="store_true", help="use neither the example database nor the corpus")
    f.add_argument("--jobs", type=_positive(int), default=1, metavar="N",
                   help="N campaigns at once, one process each, each with the whole --budget / --max-examples "
                        "(own seeds; shared corpus, example database and Triton cache), merged into one report; "
                        "on a GPU host, up to the CPU cores")
    f.add_argument("--job-index", type=int, default=None, help=argparse.SUPPRESS)
    f.add_argument("--job-count", type=int, default=None, help=argparse.SUPPRESS)
    f.add_argument("--model", metavar="NAME", default=None,
                   help="search at this served layer's shape (`moe-lora-harness models`): H, I, E, top_k and the "
                        "activation fixed, the token count from --tokens, the rest drawn")
    f.add_argument("--model-config", metavar="PATH", default=None,
                   help="the same for the MoE layer of a config.json (a file, or a folder holding one)")
    f.add_argument("--tp", type=_positive(int), default=None, metavar="N", help="with --model: one TP rank's slice")
    f.add_argument("--ep", type=_positive(int), default=None, metavar="N", help="with --model: EP over N ranks")
    f.add_argument("--tokens", type=_token_list, default=None, metavar="LIST",
                   help="with --model: the token counts drawn from (default 1,7,64,256,4096+17)")
    palette_option(f)
    f.set_defaults(fn=cmd_fuzz)
    t = sub.add_parser("selftest", help="run the project's planted-bug corpora through check and fuzz: the kill "
                                        "matrix; fails if a planted bug survives or a correct backend fails")
    common(t)
    t.add_argument("--corpus", action="append", default=[], metavar="NAME",
                   help=f"only these corpora ({', '.join(c.name for c in _corpora())}; repeatable)")
    t.add_argument("--detectors", default="check,fuzz", metavar="LIST", help="comma-separated: check, fuzz")
    t.add_argument("--fuzz-budget", type=parse_budget, default=None, metavar="DURATION",
                   help="per mutant (default 20s; 5s with --quick)")
    t.add_argument("--quick", action="store_true", help="the bounded form CI runs: short fuzz budgets")
    t.add_argument("--budget", type=parse_budget, default=None, metavar="DURATION",
                   help="stop after this long (90s, 10m): the kill matrix of what finished, the JSON marked partial, "
                        "exit 1")
    t.add_argument("--write-order", metavar="PATH", default=None,
                   help="run every check row against every mutant (not only to the first failure) and write which "
                        "rows kill which planted bugs to PATH (harness/check/check_order_data.py: check --budget's order)")
    t.add_argument("--jobs", type=_jobs_arg, default="auto", metavar="N",
                   help="N mutants and controls at once, one job process each, merged into one kill matrix (the same "
                        "as --jobs 1's); auto (the default): 1 on the CPU and with --in-process, else min(8, half "
                        "the CPU cores)")
    t.add_argument("--json", metavar="PATH")
    t.add_argument("--junit", metavar="PATH", help="JUnit XML: one test case per mutant x detector")
    t.add_argument("-v", "--verbose", action="store_true", help="also a line as each mutant starts")
    t.add_argument("-q", "--quiet", action="store_true", help="no live progress line (off anyway when not a "
                                                              "terminal, or when $CI is set)")
    t.add_argument("--power", action="store_true",
                   help="the judge's power table instead: the smallest planted slip of each class it fails, as a "
                        "multiple of the correct kernel's own error, beside assert_close(atol=rtol=2e-2)")
    t.add_argument("--model", action="append", default=[], metavar="NAME",
                   help="--power at this catalogued model's layer (repeatable; default: one H 1024 layer)")
    t.add_argument("--tokens", type=_token_list, default=None, metavar="LIST",
                   help="--power's token counts, e.g. 256,4096+17 (default 16)")
    t.add_argument("--dtype", default="", metavar="LIST", help="--power's dtypes (comma-separated)")
    t.add_argument("--rank", type=_rank_list, default=(64,), metavar="LIST",
                   help="--power's LoRA ranks, e.g. 16,32,64 (default 64)")
    t.add_argument("--quant", default="none", metavar="SCHEME",
                   help="--power's weight scheme (e.g. fp8_w8a8; default none)")
    t.add_argument("--level", choices=("expert", "op"), default="expert",
                   help="--power's level: the expert layer (default), or its two fused_moe_lora calls (w13, w2)")
    t.add_argument("--calls", type=_positive(int), default=1, metavar="N",
                   help="--power: each token count is one call's, judged over N such calls of the same layer "
                        "(decode steps; Case.call_tokens; default 1)")
    t.add_argument("--tp", type=_positive(int), default=1, metavar="N",
                   help="--power: the expert layer on N simulated TP ranks (default 1)")
    palette_option(t)
    t.set_defaults(fn=cmd_selftest)
    from moe_lora_harness.harness.front import cli_adapter
    cli_adapter.add_parser(sub)
    return p


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        args.argv = list(argv if argv is not None else sys.argv[1:])   # fuzz --jobs re-issues it per job
        if getattr(args, "reruns", 0) < 0:
            raise UsageError(f"--reruns must be >= 0; got {args.reruns}")
        return args.fn(args)
    except BrokenPipeError:   # `models --sources | head`: the reader has gone; stop quietly, as `cat` does
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # nor fail again at exit's flush
        except (OSError, ValueError, AttributeError):
            pass
        return 141
    except UsageError as e:
        cmd = (argv if argv is not None else sys.argv[1:])[:1]
        print(f"moe-lora-harness{' ' + cmd[0] if cmd and not cmd[0].startswith('-') else ''}: error: {e}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
