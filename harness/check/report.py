"""The check matrix (backend x feature) as text, JSON and Markdown; the cells a budgeted check did not reach."""
from __future__ import annotations

import json
from collections import defaultdict

from moe_lora_harness.harness.execution.runner import NO_VERDICT, STATUSES, Outcome


def cell(outcomes: list[Outcome]) -> dict:
    """Summarise one (backend, feature) cell: the worst status wins; counts and a reason."""
    counts = defaultdict(int)
    for o in outcomes:
        counts[o.status] += 1
    status = next((s for s in STATUSES if counts.get(s)), "none")   # worst first
    reason = next((o.reason for o in outcomes if o.status == status and o.reason), "")
    kinds = defaultdict(int)
    for o in outcomes:
        if o.failed:
            kinds[o.kind] += 1
    probed = defaultdict(int)        # declined cases run anyway (--probe-unsupported) that failed, by kind
    for o in outcomes:
        if o.probed:
            probed[o.kind] += 1
    # every case without a verdict, by its reason (a cell that passes may hold some: "pass 4/6 (2 not runnable
    # here)" says how many, this says why and which)
    declined: dict = {}
    for o in outcomes:
        if o.status in NO_VERDICT:
            d = declined.setdefault((o.status, o.reason), {"status": o.status, "reason": o.reason, "cases": []})
            d["cases"].append(o.case.to_json())
    return {"status": status, "counts": dict(counts), "reason": reason, "kinds": dict(kinds),
            "seconds": round(sum(o.seconds for o in outcomes), 3),     # the backend's time on the cell's cases
            "failures": [o.detail for o in outcomes if o.failed], "probed_failing": dict(probed),
            "probed_messages": [f"{o.kind}: {o.message[:300]} | CASE: {o.case.to_json()}"
                                for o in outcomes if o.probed],
            "no_verdict": list(declined.values()),
            # judged cases with row sets too small for rule 4 to fail (Verdict.unseen: rules 2 and 3 alone there)
            "rule4_unseen": sum(1 for o in outcomes if o.verdict is not None and o.verdict.unseen)}


def build_matrix(outcomes: list[Outcome], feature_of) -> dict:
    """{backend: {feature: cell}} from outcomes; `feature_of(outcome)` names its feature."""
    grouped = defaultdict(lambda: defaultdict(list))
    for o in outcomes:
        grouped[o.backend][feature_of(o)].append(o)
    return {b: {f: cell(v) for f, v in feats.items()} for b, feats in grouped.items()}


def _short(c: dict) -> str:
    s = c["status"]
    n = sum(c["counts"].values())
    if s == "pass":
        extra = c["counts"].get("unsupported", 0)
        here = c["counts"].get("not-runnable", 0)
        return (f"pass {c['counts']['pass']}/{n}" + (f" ({extra} unsup.)" if extra else "")
                + (f" ({here} not runnable here)" if here else ""))
    if s in NO_VERDICT:
        return s
    if s in ("fail", "xpass"):
        return f"{s.upper()} {c['counts'][s]}/{n}"
    return s


NOT_ASKED = "-"
LEGEND = (f"{NOT_ASKED}: not run for that backend (the row is at a level it does not provide, or does not apply to "
          f"it); unsupported: it declines the row's cases (reasons below)")
NOT_REACHED = "not-reached"
NOT_REACHED_REASON = "not reached within --budget"


def add_not_reached(matrix: dict, runs: list) -> list[dict]:
    """A budgeted check's runs not made, as (backend, feature) pairs: each cell that holds no outcome is marked
    NOT_REACHED in `matrix`; [{backend, feature, runs}] for every cell with runs left (partly run ones too)."""
    left = defaultdict(int)
    for backend, feature in runs:
        left[(backend, feature)] += 1
        matrix.setdefault(backend, {}).setdefault(feature, {
            "status": NOT_REACHED, "counts": {}, "reason": NOT_REACHED_REASON, "kinds": {}, "seconds": 0.0,
            "failures": [], "probed_failing": {}, "probed_messages": [], "no_verdict": []})
    return [{"backend": b, "feature": f, "runs": n} for (b, f), n in left.items()]


def not_reached_text(left: list[dict], budget_s: float, planned: int) -> str:
    """The runs a budgeted check did not reach, counted, and listed by row (in the order they would have run)."""
    rows = defaultdict(list)
    for c in left:
        rows[c["feature"]].append(c["backend"])
    n = sum(c["runs"] for c in left)
    return "\n".join([f"NOT REACHED within --budget {budget_s:g}s: {n} of {planned} planned runs, {len(left)} "
                      f"(backend, row) cells in {len(rows)} rows:"]
                     + [f"  {row}: {', '.join(backends)}" for row, backends in rows.items()])


def _blocks(backends: list, ws: dict, w0: int, width: int) -> list[list]:
    """The backend columns cut into blocks whose rows fit `width` characters (at least one column each)."""
    blocks, cur, used = [], [], w0
    for b in backends:
        if cur and used + 2 + ws[b] > width:
            blocks.append(cur)
            cur, used = [], w0
        cur.append(b)
        used += 2 + ws[b]
    return blocks + [cur] if cur else blocks


def to_text(matrix: dict, features: list[str], width: int | None = None) -> str:
    """The matrix as text, its backend columns in blocks that fit `width` (default: the terminal's), with a
    legend of its marks and the declared reasons."""
    import shutil
    backends = list(matrix)
    width = width or shutil.get_terminal_size((160, 24)).columns
    w0 = max([len(f) for f in features] + [7])
    cells = {b: {f: _short(matrix[b][f]) if f in matrix[b] else NOT_ASKED for f in features} for b in backends}
    ws = {b: max([len(b), 8] + [len(c) for c in cells[b].values()]) for b in backends}
    lines = []
    for i, block in enumerate(_blocks(backends, ws, w0, width)):
        head = (f"{'feature':<{w0}}  " + "  ".join(f"{b:<{ws[b]}}" for b in block)).rstrip()
        lines += ([""] if i else []) + [head, "-" * len(head)]
        lines += [(f"{f:<{w0}}  " + "  ".join(f"{cells[b][f]:<{ws[b]}}" for b in block)).rstrip() for f in features]
    import textwrap
    if any(c == NOT_ASKED for b in backends for c in cells[b].values()):
        lines += textwrap.wrap(LEGEND, width, subsequent_indent="   ")
    if any(c == NOT_REACHED for b in backends for c in cells[b].values()):
        lines += textwrap.wrap(f"{NOT_REACHED}: {NOT_REACHED_REASON} (listed below)", width, subsequent_indent="   ")
    for status, title in (("unsupported", "unsupported, as declared"), ("not-runnable", "not runnable on this machine")):
        reasons = sorted({(b, matrix[b][f]["reason"]) for b in backends for f in features
                          if f in matrix[b] and matrix[b][f]["status"] == status})
        # a cell with a verdict may hold cases without one: their reasons too, with the feature they belong to
        reasons += sorted({(f"{b} / {f}", d["reason"]) for b in backends for f in features if f in matrix[b]
                           and matrix[b][f]["status"] not in NO_VERDICT
                           for d in matrix[b][f].get("no_verdict", ()) if d["status"] == status})
        if reasons:
            lines.append(f"\n{title}:")
            lines += [f"  {b}: {r}" for b, r in reasons]
    probed = [(b, f, matrix[b][f]["probed_failing"]) for b in backends for f in features
              if f in matrix[b] and matrix[b][f].get("probed_failing")]
    if probed:
        lines.append("\ndeclined, run anyway (--probe-unsupported), and failing as declared:")
        lines += [f"  {b} / {f}: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) for b, f, kinds in probed]
    return "\n".join(lines)


def to_markdown(matrix: dict, features: list[str], header: str = "") -> str:
    backends = list(matrix)
    out = [header] if header else []
    out.append("| feature | " + " | ".join(backends) + " |")
    out.append("|---|" + "---|" * len(backends))
    for f in features:
        cells = []
        for b in backends:
            c = matrix[b].get(f)
            if c is None:
                cells.append("")
            elif c["status"] in NO_VERDICT:
                cells.append(f"{c['status']}: {c['reason']}")
            else:
                cells.append(_short(c))
        out.append(f"| {f} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def to_json(matrix: dict, meta: dict) -> str:
    return json.dumps({"meta": meta, "matrix": matrix}, indent=1, sort_keys=True)


def to_junit(suite: str, cases: list[dict]) -> str:
    """JUnit XML for CI systems: one <testcase> per dict {classname, name, status (pass, fail, skip), message,
    detail, seconds}."""
    from xml.sax.saxutils import escape, quoteattr
    fails = sum(c["status"] == "fail" for c in cases)
    skips = sum(c["status"] == "skip" for c in cases)
    total = sum(float(c.get("seconds", 0.0)) for c in cases)
    out = ['<?xml version="1.0" encoding="utf-8"?>',
           f'<testsuites><testsuite name={quoteattr(suite)} tests="{len(cases)}" failures="{fails}" errors="0" '
           f'skipped="{skips}" time="{total:.3f}">']
    for c in cases:
        head = (f'<testcase classname={quoteattr(c["classname"])} name={quoteattr(c["name"])} '
                f'time="{float(c.get("seconds", 0.0)):.3f}"')
        if c["status"] == "fail":
            out.append(f'{head}><failure message={quoteattr(c.get("message", "")[:500])}>'
                       f'{escape(c.get("detail", ""))}</failure></testcase>')
        elif c["status"] == "skip":
            out.append(f'{head}><skipped message={quoteattr(c.get("message", "")[:500])}/></testcase>')
        else:
            out.append(f"{head}/>")
    out.append("</testsuite></testsuites>")
    return "\n".join(out) + "\n"


def matrix_junit_cases(matrix: dict, suite: str = "check") -> list[dict]:
    """One JUnit case per (backend, feature) cell of a check matrix."""
    cases = []
    for backend, feats in matrix.items():
        for feature, c in feats.items():
            status = ("fail" if c["status"] in ("fail", "xpass") else
                      "skip" if c["status"] in NO_VERDICT or c["status"] == NOT_REACHED else "pass")
            cases.append(dict(classname=f"{suite}.{backend}", name=feature, status=status,
                              message=c["reason"] or ", ".join(f"{k}={v}" for k, v in c["kinds"].items()),
                              detail="\n\n".join(c["failures"]), seconds=c.get("seconds", 0.0)))
    return cases
