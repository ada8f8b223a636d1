"""The fuzz report: each distinct failure as a `FailureRecord`, and the text, failure-NN.json, campaign.json and
JUnit written from them (one campaign, or the jobs of `fuzz --jobs N` merged by harness.search.fuzz_jobs)."""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.check.report import to_junit
from moe_lora_harness.harness.search.signatures import Signature


@dataclass(frozen=True)
class FailureRecord:
    """One distinct failure as reported: its signature, minimal case, REPRO command and failure text."""

    signature: Signature
    case: Case
    kind: str
    status: str
    seconds: float                 # when it was found, since its campaign started
    regression: bool = False       # replayed from the corpus
    shrunk: bool = True            # False: the budget ended during its shrink, or a crash/hang's shrink was cut
    repro: str = ""
    detail: str = ""
    job: int | None = None         # fuzz --jobs: the job that found it
    scenario: str = ""             # a layer failure: its shrunk scenario (JSON); `case` then describes one batch

    @property
    def environment(self) -> bool:
        """A failure of the run's environment, not of the kernel."""
        return self.kind == "environment"

    def fits(self, sig: Signature) -> bool:
        """Whether this failure (its class, the axes of its minimal case) matches `sig`."""
        return sig.fits(self.signature.klass, self.case, self.signature.semantics or None)

    def to_json(self, also_fits: list | None = None) -> dict:
        """The failure-NN.json object (`also_fits`: the signatures of the other records its case matches)."""
        d = {"signature": self.signature.text, "class": self.signature.klass, "needs": dict(self.signature.needs),
             "semantics": self.signature.semantics, "case": json.loads(self.case.to_json()), "kind": self.kind, "status": self.status,
             "seconds": self.seconds, "regression": self.regression, "shrunk": self.shrunk, "repro": self.repro,
             "detail": self.detail}
        if self.job is not None:
            d["job"] = self.job
        if self.scenario:
            d["scenario"] = json.loads(self.scenario)
        if also_fits:
            d["also_fits"] = also_fits
        return d

    @classmethod
    def from_json(cls, d: dict) -> "FailureRecord":
        """Inverse of `to_json` (`also_fits` is recomputed, not read)."""
        return cls(Signature(d["class"], tuple(sorted(d["needs"].items())), d.get("semantics", "")),
                   Case.from_json(d["case"]), d["kind"],
                   d["status"], d["seconds"], d["regression"], d["shrunk"], d["repro"], d["detail"], d.get("job"),
                   json.dumps(d["scenario"], sort_keys=True, separators=(",", ":")) if "scenario" in d else "")


def also_fits(records: list) -> list:
    """For each record, the numbers (1-based) of the other records whose signature its minimal case matches.

    Signatures are found in order, so a bug first met in a narrow form and later in a wider one can be two
    records; they may also be two bugs (a case can fail for both), so both are kept and the overlap is said.
    """
    return [[j + 1 for j, other in enumerate(records) if j != i and r.fits(other.signature)]
            for i, r in enumerate(records)]


def records_table(records: list) -> str:
    """The distinct failures as a text table, each with its minimal case and REPRO line; the records of merged
    jobs (harness.search.fuzz_jobs) name their job."""
    if not records:
        return ""
    lines = [f"{len(records)} distinct failure(s):", ""]
    for i, (r, fits) in enumerate(zip(records, also_fits(records)), 1):
        tags = ((" [regression]" if r.regression else "") + ("" if r.shrunk else " [partly shrunk]")
                + (" [environment, not a kernel bug]" if r.environment else ""))
        job = f" (job {r.job})" if r.job is not None else ""
        lines.append(f"#{i} at {r.seconds:.0f}s{job}{tags}: {r.signature.text}")
        lines.append(f"   SCENARIO: {r.scenario}" if r.scenario else f"   CASE: {r.case.to_json()}")
        lines.append(f"   REPRO: {r.repro}")
        if fits:
            lines.append(f"   ALSO FITS the signature of #{', #'.join(map(str, fits))}: perhaps one bug met in two forms")
    return "\n".join(lines)


def write_reports(records: list, summary: dict, out: str | None, junit: str | None, *, name: str, level: str,
                  seconds: float, claimed: bool, label: str = "") -> None:
    """failure-NN.json and campaign.json (`summary` plus the distinct failures) under `out`; JUnit XML at
    `junit`: one test case per distinct failure, or one for the campaign (failing when nothing was tested)."""
    if out:
        o = pathlib.Path(out)
        o.mkdir(parents=True, exist_ok=True)
        for i, (r, fits) in enumerate(zip(records, also_fits(records)), 1):
            rec = r.to_json([records[j - 1].signature.text for j in fits])
            (o / f"failure-{i:02d}.json").write_text(json.dumps(rec, indent=1, sort_keys=True))
        (o / "campaign.json").write_text(json.dumps(
            dict(summary, distinct_failures=[r.signature.text for r in records]), indent=1, sort_keys=True))
    if junit:
        cases = [dict(classname=f"fuzz.{name}", name=f"#{i} {r.signature.text}", status="fail",
                      message=r.signature.text, detail=r.detail, seconds=r.seconds) for i, r in enumerate(records, 1)]
        if not cases:
            cases = [dict(classname=f"fuzz.{name}", name=f"{level}-level campaign{label}", seconds=seconds,
                          status="pass" if claimed else "fail", message="" if claimed else "nothing tested")]
        pathlib.Path(junit).write_text(to_junit("moe-lora-harness fuzz", cases))


def print_report(records: list, fixed: list, *, name: str, level: str, device: str, examples: int, seconds: float,
                 stopped: str, out: str | None, jobs: int = 1) -> None:
    """Each failure's detail, the corpus cases that pass now (`fixed`, as JSON), the table, the closing line."""
    for r in records:
        print(r.detail + "\n")
    for c in fixed:
        print(f"FIXED since the last run (removed from the corpus): {c}")
    table = records_table(records)
    if table:
        print(table)
    env = sum(r.environment for r in records)
    print(f"\n{name}: {examples} {level}-level examples in {seconds:.0f}s on {device}"
          + (f" over {jobs} jobs" if jobs > 1 else "")
          + f", {len(records) - env} distinct failure(s)" + (f" and {env} environment failure(s)" if env else "")
          + (f"; stopped: {stopped}" if stopped else "") + (f"; reports in {out}" if out else ""))
