"""Mutation score of `check` against our own Triton kernels: every single-operator edit of a kernel's source
(an arithmetic or comparison operator swapped, a constant moved by one, one term of a mask dropped, a load's or
store's mask removed, a rounding `.to(...)` removed) planted alone, and `check --device cpu` run over the backends that reach it. A mutant
`check` passes is a survivor, listed with its edit for triage (an edit that changes no output is equivalent, not
a miss). A measurement, not a test (docs/benchmarks.md, "Mutation score").

  python bench/mutation_score.py --targets one_shot --limit 40 --out bench/results/DIR/mutation_one_shot.json
  python bench/mutation_score.py --show one_shot:12      # the edit of one mutant, as a diff

The worker processes of `check` install the mutant through `--setup mutation_score:install` with
MOE_LORA_MUTANT=<target>:<index> in their environment (this file's folder on PYTHONPATH).
"""
from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import inspect
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass

JOBS = 2          # check jobs per mutant
_OP_BACKENDS = ("triton", "triton_one_shot", "triton_one_shot_split_k", "triton_two_kernel", "triton_small_batch")
# target -> (module, function, the backends whose check rows reach it)
TARGETS = {
    "one_shot": ("moe_lora_harness.kernels.triton.one_shot", "_one_shot_kernel",
                 ("triton", "triton_one_shot", "triton_one_shot_split_k")),
    "one_shot_shrink_step": ("moe_lora_harness.kernels.triton.one_shot", "_shrink_step",
                             ("triton", "triton_one_shot", "triton_one_shot_split_k")),
    "one_shot_expand_tile": ("moe_lora_harness.kernels.triton.one_shot", "_expand_tile",
                             ("triton", "triton_one_shot", "triton_one_shot_split_k")),
    "one_shot_expand_delta": ("moe_lora_harness.kernels.triton.one_shot", "_expand_delta",
                              ("triton", "triton_one_shot", "triton_one_shot_split_k")),
    "split_k_join": ("moe_lora_harness.kernels.triton.one_shot", "_split_k_join", ("triton_one_shot_split_k",)),
    "program_pairs_resolve": ("moe_lora_harness.kernels.triton.program_pairs", "resolve_lora_expert", _OP_BACKENDS),
    "program_pairs_tokens": ("moe_lora_harness.kernels.triton.program_pairs", "block_tokens", _OP_BACKENDS),
    "small_batch": ("moe_lora_harness.kernels.triton.small_batch", "_small_batch_kernel",
                    ("triton", "triton_small_batch")),
    "two_kernel_shrink": ("moe_lora_harness.kernels.triton.two_kernel", "_shrink_kernel",
                          ("triton", "triton_two_kernel")),
    "two_kernel_expand": ("moe_lora_harness.kernels.triton.two_kernel", "_expand_kernel",
                          ("triton", "triton_two_kernel")),
    # the GEMM: triton_experts, marlin_experts (its int4 weights), oai_experts (its grouped GEMM: the permuted rows);
    # moe_sum: the indexed path is oai_experts' scatter_sum
    "moe_gemm": ("moe_lora_harness.kernels.triton.fused_moe_gemm", "_moe_gemm_kernel",
                 ("triton_experts", "marlin_experts", "oai_experts")),
    "moe_sum": ("moe_lora_harness.kernels.triton.moe_sum", "_sum_pairs_kernel",
                ("triton_experts", "oai_experts", "marlin_experts")),
}
_SWAP = {ast.Add: "-", ast.Sub: "+", ast.Mult: "+", ast.FloorDiv: "*", ast.Mod: "//", ast.BitAnd: "|",
         ast.BitOr: "&", ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">", ast.Eq: "!=", ast.NotEq: "=="}
_TEXT = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Mod: "%", ast.BitAnd: "&",
         ast.BitOr: "|", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}


@dataclass(frozen=True)
class Mutant:
    """One edit of a function's dedented source: the text at [start, end) replaced by `new`."""

    target: str
    index: int
    line: int          # 1-based, in the function's source
    what: str
    start: int
    end: int
    new: str


def _source(target: str):
    module, name, _ = TARGETS[target]
    fn = getattr(importlib.import_module(module), name)
    py = getattr(fn, "fn", fn)
    return fn, textwrap.dedent(inspect.getsource(py))


def _offsets(source: str) -> list:
    """Each line's starting offset in `source`."""
    starts, at = [], 0
    for line in source.splitlines(True):
        starts.append(at)
        at += len(line)
    return starts


def mutants(target: str) -> list:
    """Every single-operator mutant of the target's source, in source order (the body only: not the signature)."""
    _, source = _source(target)
    tree = ast.parse(source)
    func = tree.body[0]
    starts = _offsets(source)

    def pos(lineno, col):
        return starts[lineno - 1] + col

    found = []

    def add(node, what, start, end, new):
        found.append((node.lineno, what, start, end, new))

    body_start = pos(func.body[0].lineno, 0)
    for node in ast.walk(func):
        if not hasattr(node, "lineno") or pos(node.lineno, node.col_offset) < body_start:
            continue
        if isinstance(node, (ast.BinOp, ast.Compare)):
            left = node.left
            ops = [node.op] if isinstance(node, ast.BinOp) else node.ops
            rights = [node.right] if isinstance(node, ast.BinOp) else node.comparators
            for op, right in zip(ops, rights):
                a, b = pos(left.end_lineno, left.end_col_offset), pos(right.lineno, right.col_offset)
                text = _TEXT.get(type(op))
                gap = source[a:b]
                i = gap.find(text) if text else -1
                if i >= 0 and type(op) in _SWAP:
                    add(node, f"{text} -> {_SWAP[type(op)]}", a + i, a + i + len(text), _SWAP[type(op)])
                left = right
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitAnd):   # one term of a mask dropped
                s, e = pos(node.lineno, node.col_offset), pos(node.end_lineno, node.end_col_offset)
                for keep, name in ((node.left, "right"), (node.right, "left")):
                    seg = ast.get_source_segment(source, keep)
                    add(node, f"mask's {name} term dropped", s, e, f"({seg})")
        elif isinstance(node, ast.Constant) and type(node.value) is int and not isinstance(node.value, bool):
            s, e = pos(node.lineno, node.col_offset), pos(node.end_lineno, node.end_col_offset)
            for new in {node.value + 1, node.value - 1} - {-1}:
                add(node, f"{node.value} -> {new}", s, e, str(new))
        elif isinstance(node, ast.Constant) and type(node.value) is float:
            s, e = pos(node.lineno, node.col_offset), pos(node.end_lineno, node.end_col_offset)
            add(node, f"{node.value} -> {node.value + 1.0}", s, e, repr(node.value + 1.0))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("load", "store")
              and any(k.arg == "mask" for k in node.keywords)):     # a load's or store's mask (and other) removed
            s, e = pos(node.lineno, node.col_offset), pos(node.end_lineno, node.end_col_offset)
            keep = [ast.get_source_segment(source, a) for a in node.args]
            keep += [ast.get_source_segment(source, k) for k in node.keywords if k.arg not in ("mask", "other")]
            add(node, f"{node.func.attr}'s mask removed", s, e,
                f"{ast.get_source_segment(source, node.func)}({', '.join(keep)})")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to"
              and len(node.args) == 1 and not node.keywords):        # a cast (a rounding point) removed
            s, e = pos(node.lineno, node.col_offset), pos(node.end_lineno, node.end_col_offset)
            add(node, f".to({ast.get_source_segment(source, node.args[0])}) removed", s, e,
                f"({ast.get_source_segment(source, node.func.value)})")
    found.sort(key=lambda f: (f[2], f[3], f[4]))
    return [Mutant(target, i, line, what, s, e, new) for i, (line, what, s, e, new) in enumerate(found)]


def mutated_source(m: Mutant) -> tuple[str, str]:
    """(original, mutated) dedented source of the mutant's function."""
    _, source = _source(m.target)
    return source, source[:m.start] + m.new + source[m.end:]


_held = []


def install() -> None:
    """`check --setup`: plant the mutant MOE_LORA_MUTANT names in this worker process for its whole life."""
    from moe_lora_harness.suites.kernels.source_mutants import Edit, installed, mutated
    target, index = os.environ["MOE_LORA_MUTANT"].rsplit(":", 1)
    if os.environ.get("MOE_LORA_MUTANT_UNGUARDED"):    # --unguarded: the tensors handed over without guard bands
        from moe_lora_harness.harness.build import guards
        guards.GUARD_MAX_BYTES = -1
    m = mutants(target)[int(index)]
    if f"{m.line}:{m.what}" != os.environ.get("MOE_LORA_MUTANT_EDIT", f"{m.line}:{m.what}"):
        raise RuntimeError(f"mutant {target}:{index} is now {m.what!r} at line {m.line}, not the campaign's "
                           f"{os.environ['MOE_LORA_MUTANT_EDIT']!r}: the source changed under the campaign")
    fn, _ = _source(target)
    old, new = mutated_source(m)
    ctx = installed((fn, mutated(fn, [Edit(old, new)], tag=f"{target}:{index}")))
    ctx.__enter__()
    _held.append(ctx)


def pytest_configure(config) -> None:
    """`pytest -p mutation_score` (this folder on PYTHONPATH): the mutant MOE_LORA_MUTANT names planted for the
    session, in every xdist worker too (the second stage: the test suites a check survivor meets)."""
    if os.environ.get("MOE_LORA_MUTANT"):
        install()


UNGUARDED = {}     # --unguarded sets MOE_LORA_MUTANT_UNGUARDED here


def _env(m: Mutant) -> dict:
    return dict(os.environ, **UNGUARDED, MOE_LORA_MUTANT=f"{m.target}:{m.index}",
                MOE_LORA_MUTANT_EDIT=f"{m.line}:{m.what}", TRITON_INTERPRET="1",
                PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                            os.environ.get("PYTHONPATH", "")]))


def _planting_tests(paths: list) -> list:
    """The test files under `paths` that plant source mutants of their own: they cannot run while the campaign's is
    planted (source_mutants: mutants do not nest), so their failures would be false kills."""
    files = []
    for path in paths:
        p = pathlib.Path(path)
        for f in ([p] if p.is_file() else sorted(p.rglob("test_*.py"))):
            if "installed(" in f.read_text():
                files.append(str(f))
    return files


def run_tests(m: Mutant, paths: list, timeout: int) -> dict:
    """The CPU gate's pytest over `paths` with the mutant planted: killed when any test fails (the tests that plant
    mutants of their own left out)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "mutation_score",
           "-n", str(JOBS), *paths, *(f"--ignore={f}" for f in _planting_tests(paths))]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, env=dict(_env(m), MOE_LORA_HARNESS_PROFILE="ci", OMP_NUM_THREADS="1"),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(tests="killed", tests_how="timeout", tests_seconds=round(time.time() - t0, 1))
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    failed = proc.returncode in (1, 2) and " failed" in last      # -x under xdist ends as interrupted (2)
    return dict(tests="killed" if failed else "survived" if proc.returncode == 0 else "error",
                tests_how=last[-200:], tests_seconds=round(time.time() - t0, 1))


def run_one(m: Mutant, timeout: int) -> dict:
    """`check --device cpu` over the target's backends with the mutant planted: its counts and verdict."""
    backends = TARGETS[m.target][2]
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "check.json")
        env = _env(m)
        cmd = [sys.executable, "-m", "moe_lora_harness", "check", "--device", "cpu", "-q", "--json", report,
               "--setup", "mutation_score:install", "--timeout", "60", "--jobs", str(JOBS)]
        for b in backends:
            cmd += ["--only", b]
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            return dict(status="killed", how="timeout", seconds=round(time.time() - t0, 1))
        seconds = round(time.time() - t0, 1)
        if not os.path.exists(report):
            return dict(status="error", how=f"rc {rc}: {(proc.stderr or proc.stdout)[-300:]}", seconds=seconds)
        counts = json.load(open(report))["meta"]["counts"]
    bad = counts.get("fail", 0) + counts.get("not-runnable", 0) + counts.get("xpass", 0)
    return dict(status="killed" if bad or rc else "survived", counts=counts, rc=rc, seconds=seconds)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, from {', '.join(TARGETS)}")
    p.add_argument("--limit", type=int, default=0, help="at most this many mutants per target, drawn with --seed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=240, help="seconds per mutant's check (past it: killed, a hang)")
    p.add_argument("--out", help="write every mutant's result as JSON")
    p.add_argument("--tests", default="", help="comma-separated test paths each check survivor then meets under "
                   "pytest (the CPU gate's profile), e.g. src/moe_lora_harness/suites/kernels")
    p.add_argument("--index", help="only these mutants (comma-separated indices; with one target)")
    p.add_argument("--edits", help="only the mutants whose edit's description contains this text (e.g. mask)")
    p.add_argument("--unguarded", action="store_true", help="hand the tensors over without guard bands (to "
                   "measure what the bands add)")
    p.add_argument("--rerun", help="a previous --out file: only its check survivors, through --tests")
    p.add_argument("--show", help="TARGET:INDEX: print that mutant's edit as a diff and stop")
    args = p.parse_args(argv)
    if args.show:
        target, index = args.show.rsplit(":", 1)
        old, new = mutated_source(mutants(target)[int(index)])
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), target, "mutant", n=1))
        return 0
    if args.unguarded:
        UNGUARDED["MOE_LORA_MUTANT_UNGUARDED"] = "1"
    results = []
    if args.rerun:
        for r in json.load(open(args.rerun)):
            if r["status"] == "survived" and args.tests:     # found again by its edit (indices move with the source)
                m = next(m for m in mutants(r["target"]) if (m.line, m.what) == (r["line"], r["edit"]))
                r["index"] = m.index
                r.update(run_tests(m, args.tests.split(","), args.timeout * 4))
                print(f"  {m.target}:{m.index:<4} line {m.line:<4} {m.what:40s} tests {r['tests']:9s} "
                      f"{r['tests_how']} {r['tests_seconds']}s", flush=True)
            results.append(r)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        return 0
    for target in args.targets.split(","):
        ms = [m for m in mutants(target) if (not args.edits or args.edits in m.what)
              and (not args.index or str(m.index) in args.index.split(","))]
        chosen = ms if not args.limit or len(ms) <= args.limit else sorted(
            random.Random(args.seed).sample(ms, args.limit), key=lambda m: m.index)
        print(f"{target}: {len(ms)} mutants, running {len(chosen)}", flush=True)
        for m in chosen:
            r = run_one(m, args.timeout)
            if r["status"] == "survived" and args.tests:
                r.update(run_tests(m, args.tests.split(","), args.timeout * 4))
            results.append(dict(target=target, index=m.index, line=m.line, edit=m.what, **r))
            print(f"  {target}:{m.index:<4} line {m.line:<4} {m.what:40s} {r['status']:9s} "
                  f"{r.get('counts', r.get('how', ''))} {r['seconds']}s", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
    by = {}
    for r in results:
        by.setdefault(r["target"], []).append(r["status"])
    for t, s in by.items():
        print(f"{t}: {s.count('killed')} killed, {s.count('survived')} survived, {s.count('error')} errors of {len(s)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
