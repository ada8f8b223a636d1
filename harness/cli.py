"""`moe-lora-harness`: check every registered backend (the matrix), replay one case, list, fuzz.

  moe-lora-harness check [--backend MOD:ATTR] [--only NAME] [--device D] [--more] [--json F] [--markdown F]
  moe-lora-harness replay --case JSON|FILE|- [--only NAME] [--backend MOD:ATTR] [--device D]
  moe-lora-harness fuzz --only NAME [--level op|expert] [--max-examples N] [--device D]
  moe-lora-harness list
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def _default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _prepare(device: str | None) -> str:
    """Pick the device; without CUDA, Triton kernels must run in the interpreter (set before import)."""
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        has_cuda = False
    if not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    d = device or ("cuda" if has_cuda else "cpu")
    if d.startswith("cuda") and not has_cuda:
        raise SystemExit("error: --device cuda given but no CUDA device is available")
    return d


def _backends(args):
    from moe_lora_harness.harness.registry import BackendLoadError, available_backends, select
    try:
        return select(available_backends(extra_refs=args.backend or []), args.only)
    except BackendLoadError as e:
        raise SystemExit(f"error: {e}") from None


def cmd_check(args) -> int:
    device = _prepare(args.device)
    from moe_lora_harness.harness.features import FEATURES, feature_cases
    from moe_lora_harness.harness.report import build_matrix, to_json, to_markdown, to_text
    from moe_lora_harness.harness.runner import run_case
    specs = _backends(args)
    n = args.cases_per_feature or (6 if args.more else 2)
    cases = feature_cases(FEATURES, device, n)
    feature_of = {}
    outcomes = []
    t0 = time.time()
    for name, spec in specs.items():
        t1 = time.time()
        for feat, i, case in cases:
            if case.level not in spec.capabilities.levels:   # not a claim either way: no entry point
                continue
            o = run_case(spec, case, device, probe=args.probe_unsupported)
            feature_of[id(o)] = feat.name
            outcomes.append(o)
            if o.failed and args.verbose:
                print(o.detail, file=sys.stderr)
        print(f"[{name}: {time.time() - t1:.1f}s]", file=sys.stderr)
    matrix = build_matrix(outcomes, lambda o: feature_of[id(o)])
    names = [f.name for f in FEATURES]
    print(to_text(matrix, names))
    failures = [o for o in outcomes if o.failed]
    unclaimed = [o for o in outcomes if o.status == "works-unclaimed"]
    for o in unclaimed:
        print(f"NOTE {o.backend} works where it claims not to: {o.reason}: {o.case.to_json()}")
    for o in failures:
        print("\n" + o.detail)
    meta = {"device": device, "cases_per_feature": n, "seconds": round(time.time() - t0, 1),
            "backends": {s.name: s.description for s in specs.values()}}
    if args.json:
        with open(args.json, "w") as f:
            f.write(to_json(matrix, meta))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(to_markdown(matrix, names, f"Conformance on {device} ({n} cases per feature)\n"))
    total = len(outcomes)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("pass", "fail", "xpass", "xfail",
                                                               "unsupported", "works-unclaimed")}
    print(f"\n{total} runs: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v)
          + f" in {time.time() - t0:.0f}s on {device}")
    return 1 if failures else 0


def read_case_arg(arg: str):
    """--case: the case JSON itself, a file holding it, or '-' for stdin -> Case (ValueError saying which)."""
    import json
    import pathlib
    import sys

    from moe_lora_harness.harness.case import Case
    text = arg
    if arg == "-":
        text = sys.stdin.read()
    elif not arg.lstrip().startswith("{"):
        path = pathlib.Path(arg)
        if not path.is_file():
            raise ValueError(f"--case: expected the case JSON (as printed after CASE:), a file holding it, or '-'; "
                             f"got {arg[:80]!r}, which is neither JSON nor an existing file")
        text = path.read_text()
    try:
        return Case.from_json(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--case: not valid JSON ({e})") from None
    except TypeError as e:
        raise ValueError(f"--case: {e}") from None


def cmd_replay(args) -> int:
    try:
        case = read_case_arg(args.case)
    except ValueError as e:
        print(f"moe-lora-harness replay: {e}", file=sys.stderr)
        return 2
    device = _prepare(args.device)
    from moe_lora_harness.harness.runner import run_case
    specs = _backends(args)
    rc = 0
    for name, spec in specs.items():
        o = run_case(spec, case, device, probe=True)
        v = o.verdict.summary() if o.verdict else ""
        print(f"{name}: {o.status} {o.reason} {v}".rstrip())
        if o.failed:
            print(o.detail)
            rc = 1
    return rc


def cmd_list(args) -> int:
    _prepare(None)
    for name, spec in _backends(args).items():
        cap = spec.capabilities
        print(f"{name}: {spec.description}\n    levels={sorted(cap.levels)} devices={sorted(cap.devices)} "
              f"layouts={sorted(cap.layouts)} max_rank={cap.max_rank} origin={spec.origin}")
        for (dev, dt), why in sorted(cap.dtype_reasons.items()):
            print(f"    no {dt} on {dev}: {why}")
        for r in cap.rules:
            print(f"    rule {r.name}: {r.reason}")
        for b in spec.known_bugs:
            print(f"    known bug {b.issue}: {b.description}")
    return 0


def cmd_fuzz(args) -> int:
    """Search for a failing case (op or expert level) with hypothesis and shrink it to the smallest one."""
    device = _prepare(args.device)
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from moe_lora_harness.harness.runner import run_case
    from moe_lora_harness.harness.strategies import expert_cases, load_profile, op_cases
    load_profile("fuzz")
    specs = _backends(args)
    if len(specs) != 1:
        raise SystemExit(f"error: fuzz one backend at a time (--only NAME); have {sorted(specs)}")
    (name, spec), = specs.items()
    dtypes = ("float16", "float32") if device == "cpu" else ("bfloat16", "float16", "float32")
    found = {}

    @settings(max_examples=args.max_examples,
              database=None if args.no_db else settings.default.database)
    @given(st.data())
    def search(data):
        if args.level == "expert":
            case = data.draw(expert_cases(dtypes=dtypes, max_T=10 if device == "cpu" else 256,
                                          max_dim=96 if device == "cpu" else 1024))
        else:
            case = data.draw(op_cases(dtypes=dtypes, max_T=12 if device == "cpu" else 256,
                                      max_dim=96 if device == "cpu" else 1024))
        o = run_case(spec, case, device)
        if o.failed:
            found["outcome"] = o
            raise AssertionError(o.detail)

    if args.seed is not None:
        from hypothesis import seed as hseed
        search = hseed(args.seed)(search)
    try:
        search()
    except AssertionError:
        o = found["outcome"]
        print(f"smallest failing case found for {name}:\n{o.detail}")
        return 1
    print(f"{name}: no failure in {args.max_examples} examples on {device}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moe-lora-harness", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("--backend", action="append", default=[], metavar="MODULE:ATTR",
                        help="add a backend (BackendSpec, list, factory, or fused_moe_lora-signature function)")
        sp.add_argument("--only", action="append", default=[], metavar="NAME", help="restrict to these backends")
        sp.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")

    c = sub.add_parser("check", help="run the conformance features of every backend; print the matrix")
    common(c)
    c.add_argument("--cases-per-feature", type=int, default=None)
    c.add_argument("--more", action="store_true", help="6 cases per feature instead of 2")
    c.add_argument("--probe-unsupported", action="store_true",
                   help="also run declined cases and report those that pass")
    c.add_argument("--json", metavar="PATH")
    c.add_argument("--markdown", metavar="PATH")
    c.add_argument("-v", "--verbose", action="store_true")
    c.set_defaults(fn=cmd_check)
    r = sub.add_parser("replay", help="replay one case (JSON) against the backends")
    common(r)
    r.add_argument("--case", required=True,
                   help="the case JSON printed by a failure (after CASE:), a file holding it, or - for stdin")
    r.set_defaults(fn=cmd_replay)
    l_ = sub.add_parser("list", help="list backends and their declared capabilities")
    common(l_)
    l_.set_defaults(fn=cmd_list)
    f = sub.add_parser("fuzz", help="search for the smallest failing case of one backend")
    common(f)
    f.add_argument("--max-examples", type=int, default=300)
    f.add_argument("--level", choices=("op", "expert"), default="op",
                   help="attack the op (fused_moe_lora) or an expert backend's forward")
    f.add_argument("--seed", type=int, default=None, help="fix hypothesis' random seed (reproducible search)")
    f.add_argument("--no-db", action="store_true", help="do not use the example database")
    f.set_defaults(fn=cmd_fuzz)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
