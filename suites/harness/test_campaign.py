"""Fuzz campaigns (harness/search/campaign.py, `moe-lora-harness fuzz --budget`): one run reports every distinct
failure of a backend with several independent bugs, each with a minimal case and its REPRO; a crash or a
hang is one more distinct failure and the campaign goes on; a known failure is replayed first from the
corpus; signatures (harness/search/signatures.py); reports (harness/search/fuzz_report.py: JSON, JUnit) are written."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from moe_lora_harness.harness.search.campaign import Campaign
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.contract import BackendSpec, Capabilities
from moe_lora_harness.harness.execution.execute import InProcess
from moe_lora_harness.harness.search.fuzz_report import FailureRecord
from moe_lora_harness.harness.spec.registry import harness_command, load_ref
from moe_lora_harness.harness.search.signatures import Signature, axes_of, failure_class
from moe_lora_harness.harness.draw.strategies import claimed_cases
from moe_lora_harness.harness.execution.worker import Supervisor
from moe_lora_harness.reference.lora_op import fused_moe_lora as ref_op

SIZES = dict(max_T=12, max_dim=48)


def _three_bugs(**kw):
    """Three independent defects: offset columns zeroed, no store without add_inputs, a raise for rank > 64."""
    if int(kw["max_lora_rank"]) > 64:
        raise ValueError("rank too large")
    if not kw.get("add_inputs", True):
        return
    ref_op(**kw, precision="one_shot")
    if kw.get("offset", 0):
        kw["output"][:, :, :kw["offset"]] = 0


THREE_BUGS = BackendSpec(name="three-bugs", description=_three_bugs.__doc__,
                         capabilities=Capabilities(levels=frozenset({"op"})), op=_three_bugs, precision="one_shot")


def _campaign(spec, executor, **kw):
    c = Campaign(spec, "cpu", "op", executor, reruns=kw.pop("reruns", 0), **kw)
    return c.run(claimed_cases(spec, "cpu", "op", **SIZES))


def test_one_campaign_reports_each_independent_bug():
    result = _campaign(THREE_BUGS, InProcess(), max_examples=120, seed=11)
    classes = {f.signature.klass: f for f in result.found}
    texts = [f.signature.text for f in result.found]
    assert any(k.startswith("raised: ValueError: rank too large") for k in classes), texts
    assert any(f.signature.needs == (("add_inputs", "False"),) for f in result.found), texts
    assert any(("offset", "nonzero") in f.signature.needs for f in result.found), texts
    assert len(result.found) == 3, texts          # each bug once, not once per variant
    for f in result.found:
        assert f.outcome.failed and f"REPRO: {f.outcome.repro}" in f.outcome.detail
        assert f"{harness_command()} replay" in f.record().repro


@pytest.mark.starts_first
def test_a_crash_and_a_hang_are_failures_and_the_campaign_goes_on(monkeypatch):
    from moe_lora_harness.harness.search import campaign
    monkeypatch.setattr(campaign, "MAX_SLOW_SHRINK_STEPS", 3)   # each step costs a timeout or a worker start
    spec = {s.name: s for s in load_ref("moe_lora_harness.suites.harness.multi_bug_backends:BACKENDS")}["crash-and-hang"]
    # bounded by examples, not time: the same search on any machine; a normal call takes under 0.1 s and each
    # of the search's 13 hangs costs the timeout
    with Supervisor(timeout=0.5) as sup:
        result = _campaign(spec, sup, seed=3, max_examples=45)
    classes = sorted(f.signature.klass for f in result.found)
    assert any(k.startswith("crash: exited with code 3") for k in classes), classes
    assert "hang" in classes, classes
    assert result.examples > len(result.found) + 5   # the search went on past both


def test_failures_found_before_are_replayed_first(tmp_path):
    first = _campaign(THREE_BUGS, InProcess(), max_examples=60, seed=11, corpus_dir=str(tmp_path))
    assert first.found and list(tmp_path.glob("*.json"))
    again = _campaign(THREE_BUGS, InProcess(), max_examples=len(first.found), seed=99, corpus_dir=str(tmp_path))
    assert [f.regression for f in again.found[:len(first.found)]] == [True] * len(first.found)
    assert {f.signature for f in again.found} >= {f.signature for f in first.found}


def test_signature_matching():
    sig = Signature("per-element bound", (("offset", "nonzero"),))
    assert sig.matches("per-element bound", {"offset": "nonzero", "dtype": "float32"})
    assert not sig.matches("per-element bound", {"offset": "0"})
    assert not sig.matches("non-finite output", {"offset": "nonzero"})
    assert axes_of(Case(offset=3, which="w2", num_slices=1))["offset"] == "nonzero"


def test_fuzz_cli_writes_json_junit_and_exits_1(tmp_path, monkeypatch):
    from moe_lora_harness.harness.front import cli
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["fuzz", "--backend", "moe_lora_harness.harness.selftest.mutants:MUTANTS", "--only", "mutant-drops-slice",
                   "--max-examples", "40", "--seed", "2", "--in-process", "--reruns", "0", "--out", "out",
                   "--junit", "f.xml", "--no-db", "-q"])
    assert rc == 1
    summary = json.loads((tmp_path / "out" / "campaign.json").read_text())
    assert summary["distinct_failures"] and (tmp_path / "out" / "failure-01.json").exists()
    record = json.loads((tmp_path / "out" / "failure-01.json").read_text())
    # (an uninstalled checkout's repro line starts with the PYTHONPATH it needs)
    assert f"{harness_command()} replay" in record["repro"] and Case.from_json(record["case"]).problems() == []
    suite = ET.parse(tmp_path / "f.xml").getroot().find("testsuite")
    assert int(suite.get("failures")) == len(summary["distinct_failures"]) >= 1


def test_failure_class_names_the_exception():
    from moe_lora_harness.harness.execution.runner import run_case
    o = run_case(THREE_BUGS, Case(max_rank=128, T=2), "cpu", executor=InProcess(), reruns=0)
    assert failure_class(o) == "raised: ValueError: rank too large"


def test_fuzz_jobs_run_campaigns_at_once_and_merge_them(tmp_path, monkeypatch):
    """`fuzz --jobs 2`: two processes with their own seeds, one report: examples summed, each distinct failure
    once (both jobs find the planted bug), renumbered failure files, one JUnit, exit 1."""
    from moe_lora_harness.harness.front import cli
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["fuzz", "--backend", "moe_lora_harness.harness.selftest.mutants:MUTANTS", "--only", "mutant-drops-slice",
                   "--max-examples", "15", "--seed", "2", "--in-process", "--reruns", "0", "--out", "out",
                   "--junit", "f.xml", "--no-db", "-q", "--jobs", "2"])
    assert rc == 1
    summary = json.loads((tmp_path / "out" / "campaign.json").read_text())
    assert summary["jobs"] == 2 and len(summary["examples_per_job"]) == 2 and not summary["job_errors"]
    assert summary["examples"] == sum(summary["examples_per_job"]) > 15
    files = sorted((tmp_path / "out").glob("failure-*.json"))
    assert len(files) == len(summary["distinct_failures"]) >= 1
    assert len(set(summary["distinct_failures"])) == len(summary["distinct_failures"])
    suite = ET.parse(tmp_path / "f.xml").getroot().find("testsuite")
    assert int(suite.get("failures")) == len(files)


def _record(klass: str, needs: dict, case: Case, seconds: float, shrunk: bool = True, **kw) -> FailureRecord:
    return FailureRecord(Signature(klass, tuple(sorted(needs.items()))), case, kw.pop("kind", "element"), "fail",
                         seconds, shrunk=shrunk, **kw)


def test_merged_jobs_keep_one_record_per_signature():
    """A job's partly shrunk find of a bug another job shrank (its case matches that signature) is dropped;
    a failure of another class is kept; the fully shrunk record wins even when found later."""
    from moe_lora_harness.harness.search.fuzz_jobs import distinct
    crash_case = Case(mapping="none", T=5, top_k=3, E=7)
    shrunk = _record("crash: exited with code 3", {"mapping": "none"}, Case(mapping="none"), 30.0)
    partial = _record("crash: exited with code 3", axes_of(crash_case), crash_case, 12.0, shrunk=False)
    other = _record("non-finite output", {"add_inputs": "False"}, Case(add_inputs=False), 20.0)
    assert distinct([partial, other, shrunk]) == [other, shrunk]


def test_a_failure_record_round_trips_through_its_json_file():
    """failure-NN.json holds the record's fields as before the record was typed (class, needs, case as JSON,
    seconds, REPRO ...), and reads back to the same record."""
    r = _record("per-element bound", {"offset": "nonzero"}, Case(offset=3, which="w2", num_slices=1,
                mul_routed_weight=True), 4.5, repro="moe-lora-harness replay --case {}", detail="FAIL ...", job=1)
    d = r.to_json(["another signature"])
    assert d == {"signature": "per-element bound | needs offset=nonzero", "class": "per-element bound",
                 "needs": {"offset": "nonzero"}, "semantics": "", "case": json.loads(r.case.to_json()), "kind": "element",
                 "status": "fail", "seconds": 4.5, "regression": False, "shrunk": True,
                 "repro": "moe-lora-harness replay --case {}", "detail": "FAIL ...", "job": 1,
                 "also_fits": ["another signature"]}
    assert FailureRecord.from_json(json.loads(json.dumps(d))) == r


def test_a_routed_weight_bug_met_on_w2_or_on_w13_gets_one_signature():
    """The planted wrong-x-row bug (mul_routed_weight reads the token's row) fails every w2 case and the w13
    cases that multiply: shrunk to either, its signature is the same, so a campaign reports it once."""
    from moe_lora_harness.harness.execution.runner import run_case
    from moe_lora_harness.harness.selftest.selftest import CORPORA
    from moe_lora_harness.harness.search.signatures import needed_axes
    corpus = next(c for c in CORPORA if c.name == "op")
    spec = next(s for s in load_ref(corpus.ref) if s.name == "mutant-wrong-x-row")
    w2 = Case(T=5, H=32, I=24, E=4, top_k=2, which="w2", num_slices=1, mul_routed_weight=True, seed=3)
    w13 = Case(T=5, H=32, I=24, E=4, top_k=2, mul_routed_weight=True, seed=3)
    sigs = []
    for case in (w2, w13):
        o = run_case(spec, case, "cpu", reruns=0, diagnose=False)
        assert o.failed, case.to_json()
        sigs.append(Signature(failure_class(o), needed_axes(spec, o, "cpu", InProcess())))
    assert sigs[0] == sigs[1] and ("mul_routed_weight", "True") in sigs[0].needs, [s.text for s in sigs]
    assert run_case(spec, w13.replace(mul_routed_weight=False), "cpu", reruns=0).status == "pass"


def test_a_record_whose_case_fits_another_signature_says_so(tmp_path):
    """Two records that may be one bug met in two forms (the first's case matches the second's signature) are
    both kept and the table and failure file name the overlap; unrelated records name none."""
    from moe_lora_harness.harness.search.fuzz_report import also_fits, records_table, write_reports
    narrow = _record("per-element bound", {"which": "w2"}, Case(which="w2", num_slices=1, mul_routed_weight=True),
                     5.0, repro="r1")
    wide = _record("per-element bound", {"mul_routed_weight": "True"}, Case(mul_routed_weight=True), 9.0, repro="r2")
    other = _record("non-finite output", {"add_inputs": "False"}, Case(add_inputs=False), 12.0, repro="r3")
    assert also_fits([narrow, wide, other]) == [[2], [], []]
    table = records_table([narrow, wide, other])
    assert table.count("ALSO FITS") == 1 and "ALSO FITS the signature of #2" in table
    write_reports([narrow, wide, other], {}, str(tmp_path), None, name="x", level="op", seconds=1.0, claimed=True)
    assert json.loads((tmp_path / "failure-01.json").read_text())["also_fits"] == [wide.signature.text]
    assert "also_fits" not in json.loads((tmp_path / "failure-02.json").read_text())
