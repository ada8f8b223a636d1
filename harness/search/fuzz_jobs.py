"""`fuzz --jobs N`: N campaigns against one backend at once, one process each, merged into one report.

Each job is the same `fuzz` command with its own hypothesis seed and output directory; the jobs share the
failure corpus, the example database and the Triton cache (a kernel one job compiled, the others load).
On a GPU host the device is mostly idle between a campaign's small launches and the time goes to the CPU
(compiles, the float64 judge), so jobs multiply examples per minute by up to the cores they get. The merge
keeps each distinct failure once (by signature: the earliest found), renumbers the failure files, sums the
examples, and exits like one campaign: 1 if anything failed.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

from moe_lora_harness.harness.search.fuzz_report import FailureRecord, print_report, write_reports
from moe_lora_harness.harness.execution.worker import child_env, share_cores

SEED_STRIDE = 1000     # job i searches from seed + i * SEED_STRIDE when --seed is given


def child_argv(argv: list, i: int, out_dir: str, jobs: int = 1) -> list:
    """The command of job i of `jobs`: the user's own arguments, then the job's (argparse keeps an option's last
    value; the job count so that a job takes its share of the device's memory)."""
    return [sys.executable, "-m", "moe_lora_harness.harness.front.cli", *argv, "--jobs", "1", "--job-index", str(i),
            "--job-count", str(jobs), "--out", out_dir]


def _records(job_dir: pathlib.Path, job: int) -> list:
    """The FailureRecords job `job` wrote."""
    return [replace(FailureRecord.from_json(json.loads(p.read_text())), job=job)
            for p in sorted(job_dir.glob("failure-*.json"))]


def distinct(records: list) -> list:
    """The records one campaign would have kept: fully shrunk first, then by time found, a record is dropped
    when its class and case match a kept one's signature (its class, and the values its minimal case needs),
    as a campaign stops hunting a signature once found. Two jobs' partly shrunk finds of one bug merge so."""
    kept = []
    for r in sorted(records, key=lambda r: (not r.shrunk, r.seconds)):
        if not any(r.fits(k.signature) for k in kept):
            kept.append(r)
    return sorted(kept, key=lambda r: r.seconds)


def merge(job_dirs: list) -> dict:
    """One campaign's summary from the jobs' outputs: distinct failures (earliest first), examples summed."""
    summaries, found, errors = [], [], []
    for i, d in enumerate(job_dirs):
        path = d / "campaign.json"
        if not path.exists():
            errors.append(i)
            continue
        summaries.append(json.loads(path.read_text()))
        found += _records(d, i)
    records = distinct(found)
    return {"jobs": len(job_dirs), "job_errors": errors, "summaries": summaries, "records": records,
            "examples": sum(s["examples"] for s in summaries),
            "seconds": max((s["seconds"] for s in summaries), default=0.0),
            "claimed": any(s.get("claimed", True) for s in summaries),
            "fixed": sorted({c for s in summaries for c in s.get("fixed_since_last_run", [])})}


def run_jobs(argv: list, jobs: int, out: str | None, junit: str | None, name: str, level: str, device: str,
             quiet: bool) -> int:
    """Run `jobs` campaigns of the fuzz command `argv` at once; print and write the merged report."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="moe-lora-fuzz-jobs-"))
    dirs = [tmp / f"job-{i}" for i in range(jobs)]
    logs = [open(tmp / f"job-{i}.log", "wb") for i in range(jobs)]
    env = child_env()
    # the cores shared out: each job's torch threads (and its worker's) get their share, unless the user set it
    share_cores(env, jobs)
    procs = [subprocess.Popen(child_argv(argv, i, str(d), jobs), stdout=logs[i], stderr=subprocess.STDOUT,
                              env=env, start_new_session=True) for i, d in enumerate(dirs)]
    if not quiet:
        print(f"[fuzz] {jobs} jobs (one process each, logs in {tmp})", file=sys.stderr)
    t0 = time.monotonic()
    interrupted = False
    try:
        for p in procs:
            p.wait()
    except KeyboardInterrupt:
        interrupted = True
        for p in procs:   # each job stops its own worker and writes what it found
            try:
                os.killpg(p.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    finally:
        for f in logs:
            f.close()
    m = merge(dirs)
    records = m["records"]
    wall = time.monotonic() - t0
    first = m["summaries"][0] if m["summaries"] else {}
    summary = {"backend": name, "origin": first.get("origin"), "level": level, "device": device, "jobs": jobs,
               "examples": m["examples"], "seconds": round(wall, 1), "interrupted": interrupted,
               "shapes": first.get("shapes"), "claimed": m["claimed"],
               "examples_per_job": [s["examples"] for s in m["summaries"]],
               "stopped_per_job": [s.get("stopped") for s in m["summaries"]],
               "job_errors": m["job_errors"], "fixed_since_last_run": m["fixed"]}
    write_reports(records, summary, out, junit, name=name, level=level, seconds=wall, claimed=m["claimed"],
                  label=f" ({jobs} jobs)")
    for i in m["job_errors"]:
        tail = (tmp / f"job-{i}.log").read_text(errors="replace")[-3000:]
        print(f"\njob {i} wrote no report (exit {procs[i].returncode}); its output ends:\n{tail}")
    print_report(records, m["fixed"], name=name, level=level, device=device, examples=m["examples"], seconds=wall,
                 stopped="interrupted" if interrupted else "", out=out, jobs=jobs)
    if not m["job_errors"]:
        shutil.rmtree(tmp, ignore_errors=True)
    if interrupted:
        return 130
    if m["job_errors"]:
        return 2
    if not m["claimed"] and not records:
        print(f"{name}: NOTHING TESTED: no drawn {level}-level case is claimed by its declarations on {device}")
        return 1
    return 1 if records else 0
