"""Issue 32, item 3: selftest says each mutant's verdict as it finishes, and a run stopped by Ctrl-C or by its
--budget prints and writes the kill matrix of what finished, marked partial. On a tiny corpus: four op mutants and
the control on two op rows, under check's detector (a fraction of a second each)."""
from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET

from moe_lora_harness.harness.front import cli

from moe_lora_harness.harness.selftest import selftest
from moe_lora_harness.harness.execution.execute import InProcess
import pytest

from moe_lora_harness.harness.selftest.selftest import Corpus, Kill, SelftestResult, run_selftest
from moe_lora_harness.harness.selftest.selftest_progress import SelftestProgress

ARGS = ["selftest", "--corpus", "tiny", "--detectors", "check", "--in-process", "--device", "cpu"]
TINY = Corpus("tiny", "moe_lora_harness.harness.selftest.mutants:MUTANTS", ("mutant-control",), "op",
              lambda f: f.name in ("T*k < E", "empty batch"),
              select=lambda s: s.name in ("mutant-control", "mutant-drops-slice", "mutant-truncates-rank",
                                          "mutant-clobbers-offset", "mutant-wrong-x-row"))


@pytest.fixture(autouse=True)
def tiny_corpus(monkeypatch):
    monkeypatch.setattr(selftest, "CORPORA", (TINY,))


def _stop_at_third_mutant(monkeypatch, exc):
    real, calls = selftest._mutant_cells, []

    def cells(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise exc
        return real(*a, **kw)
    monkeypatch.setattr(selftest, "_mutant_cells", cells)


def test_ctrl_c_prints_the_partial_kill_matrix_and_writes_the_partial_json(tmp_path, monkeypatch, capsys):
    _stop_at_third_mutant(monkeypatch, KeyboardInterrupt)
    rc = cli.main(ARGS + ["--json", str(tmp_path / "s.json"), "--junit", str(tmp_path / "s.xml")])
    out, err = capsys.readouterr()
    assert rc == 130, out
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["partial"] and data["stopped"] == "interrupted" and len(data["mutants"]) == 2, data
    assert data["in_flight"] in data["not_reached"] and len(data["not_reached"]) >= 2
    assert "PARTIAL (interrupted)" in out and "not reached: " in out and "PARTIAL: " in out, out
    assert all(m in out for m in data["mutants"])                                   # the matrix of what finished
    assert err.count("killed: by check at ") == 2 and "\r" not in err, err        # a plain line per mutant
    skipped = [c for c in ET.parse(tmp_path / "s.xml").getroot().iter("testcase") if c.find("skipped") is not None]
    assert len(skipped) == len(data["not_reached"])


def test_a_spent_budget_keeps_what_finished_and_fails(tmp_path, monkeypatch, capsys):
    _stop_at_third_mutant(monkeypatch, selftest.BudgetSpent)
    rc = cli.main(ARGS + ["--budget", "1h", "--json", str(tmp_path / "s.json")])
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "s.json").read_text())
    assert rc == 1 and data["partial"] and data["stopped"] == "budget" and data["budget_s"] == 3600
    assert "the --budget was spent" in out and "--budget 3600s spent" in out, out


def test_the_deadline_stops_between_rows_with_whole_cells_only(monkeypatch):
    clock, real = [0.0], selftest._check_rows

    class Clock:          # each check row takes 100 s of this clock
        monotonic = staticmethod(lambda: clock[0])

    def rows(*a):
        for row, run in real(*a):
            yield row, lambda *r, run=run: (clock.__setitem__(0, clock[0] + 100), run(*r))[1]
    monkeypatch.setattr(selftest, "time", Clock)
    monkeypatch.setattr(selftest, "_check_rows", rows)
    res = run_selftest("cpu", InProcess(), detectors=("check",), deadline=250)      # the control's 2 rows, 1 more
    assert res.stopped == "budget" and res.controls and res.in_flight == res.not_reached[0], res
    assert len(res.cells) <= 1 and res.in_flight not in res.cells and len(res.not_reached) >= 3
    res = run_selftest("cpu", InProcess(), deadline=-1)
    assert not res.cells and not res.controls and res.not_reached == res.planned and len(res.planned) == 5


def test_one_line_per_mutant_and_a_live_line_on_a_terminal():
    res = SelftestResult(cells={("op", "m"): {"check": Kill(True, 0.42, 1, row="fp16"), "fuzz": Kill(False, 5, 9)}},
                         controls={("op", "c"): []})
    out = io.StringIO()
    p = SelftestProgress(live=True, stream=out, every_s=0.0)
    p.begin(2)
    p.step(("op", "m"), "check: fp16")
    p.finished(("op", "m"), res, 1.5)
    p.finished(("op", "c"), res, 0.5)
    text = out.getvalue()
    assert "\r[selftest] 0/2 done, 0 killed, 0 survived, 0s | op/m: check: fp16" in text, text
    assert "[selftest 1/2] op/m: killed: by check at 'fp16' in 0.4s; fuzz survived (9 runs) [1.5s]\n" in text
    assert "[selftest 2/2] op/c: control passes [0.5s]\n" in text
    plain = io.StringIO()
    p = SelftestProgress(live=False, stream=plain)
    p.begin(1)
    p.step(("op", "m"), "check: fp16")
    p.finished(("op", "m"), SelftestResult(cells={("op", "m"): {"check": Kill(False, 1, 3)}}), 1.0)
    assert plain.getvalue() == "[selftest 1/1] op/m: SURVIVED: check survived (3 runs) [1.0s]\n"
