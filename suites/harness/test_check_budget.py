"""Issue 32, item 2: `check --budget` runs the rows that kill the most planted bugs first (harness/check/check_order_data.py,
from selftest's kill data), stops at the budget and reports the rows it did not reach (text, JSON, JUnit)."""
from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET

import pytest

from moe_lora_harness.harness.check import check_order

from moe_lora_harness.harness.front import cli
from moe_lora_harness.harness.check.check_order_data import ORDER


def test_rank_rows_is_a_greedy_cover_of_the_planted_bugs():
    kills = {"a": ["r1", "r2"], "b": ["r2"], "c": ["r3"], "d": ["r1", "r3"], "e": []}
    order = check_order.rank_rows(kills, ["r1", "r2", "r3", "r4"])
    assert order == ["r1", "r2", "r3"] or order == ["r1", "r3", "r2"]
    assert order[:2] == ["r1", "r2"]         # r1 kills a, d; then r2 (b) and r3 (c) tie: the earlier row first
    assert check_order.first_killers(kills, order) == {"a": "r1", "b": "r2", "c": "r3", "d": "r1"}


@pytest.mark.parametrize("kind", sorted(ORDER))
def test_every_planted_bugs_first_killer_comes_before_the_rows_that_kill_nothing(kind):
    data = ORDER[kind]
    assert data["order"] == check_order.rank_rows(data["kills"], data["rows"])       # the data is what it says
    assert data["first_killer"] == check_order.first_killers(data["kills"], data["order"])
    rows = check_order.check_rows(kind)
    ordered = sorted(rows, key=check_order.row_key(data, rows))
    killing = {r for killers in data["kills"].values() for r in killers}
    last_first_killer = max(ordered.index(r) for r in data["first_killer"].values() if r in rows)
    assert all(ordered.index(r) > last_first_killer for r in rows if r not in killing), ordered
    cover = {r for r in data["first_killer"].values() if r in rows}      # the rows that first kill some bug
    assert set(ordered[:len(cover)]) == cover, ordered


def test_the_order_data_knows_every_planted_bug_of_the_cpu_corpora_and_names_real_rows():
    from moe_lora_harness.harness.spec.registry import load_ref
    from moe_lora_harness.harness.selftest.selftest import CORPORA
    data = ORDER["cpu"]
    planted = {f"{c.name}/{s.name}" for c in CORPORA if "cpu" in c.devices for s in load_ref(c.ref)
               if c.select(s) and s.name not in c.controls}
    assert planted == set(data["kills"]), f"stale: regenerate with {check_order.REGENERATE.format(device='cpu')}"
    assert not set(data["rows"]) - set(check_order.check_rows("cpu")), "rows check no longer has"


def test_write_order_replaces_a_rerun_corpus_and_keeps_the_others(tmp_path):
    path = tmp_path / "order_data.py"
    check_order.write_data(path, "cpu", {"op/a": ["fp16"], "tp/b": ["fp32"]}, ["fp16", "fp32", "no such row"],
                           ["op/a", "tp/b"])
    d = check_order.write_data(path, "cpu", {"op/c": ["bf16"]}, ["bf16"], ["op/c"])
    assert d["kills"] == {"op/c": ["bf16"], "tp/b": ["fp32"]}        # op/a is no longer planted; tp was not re-run
    assert d["rows"] == ["bf16", "fp16", "fp32"] and d["order"] == ["bf16", "fp32"]
    assert check_order.read_data(path) == {"cpu": d}


def test_a_budget_runs_the_killing_row_first_and_lists_what_it_did_not_reach(tmp_path, monkeypatch, capsys):
    from moe_lora_harness.harness.execution import runner
    clock, real = [0.0], runner.run_case

    class Clock:          # each run takes 100 s of this clock: a 1 s budget admits exactly one
        monotonic = staticmethod(lambda: clock[0])
        time = staticmethod(time.time)

    def run_case(*a, **kw):
        clock[0] += 100
        return real(*a, **kw)
    monkeypatch.setattr(cli, "time", Clock)
    monkeypatch.setattr(runner, "run_case", run_case)
    rc = cli.main(["check", "--in-process", "--device", "cpu", "--only", "eager", "--feature", "empty batch",
                   "--feature", "T*k < E", "--cases-per-feature", "1", "--budget", "1s",
                   "--json", str(tmp_path / "m.json"), "--junit", str(tmp_path / "m.xml")])
    out = capsys.readouterr().out
    assert rc == 0, out
    data = json.loads((tmp_path / "m.json").read_text())
    assert data["matrix"]["eager"]["T*k < E"]["status"] == "pass"                  # the row that kills bugs ran
    assert data["matrix"]["eager"]["empty batch"]["status"] == "not-reached"
    assert data["meta"]["not_reached"] == [{"backend": "eager", "feature": "empty batch", "runs": 1}]
    assert "NOT REACHED within --budget 1s: 1 of 2 planned runs" in out and "  empty batch: eager" in out, out
    skipped = [c for c in ET.parse(tmp_path / "m.xml").getroot().iter("testcase") if c.find("skipped") is not None]
    assert [(c.get("name"), c.find("skipped").get("message")) for c in skipped] == [
        ("empty batch", "not reached within --budget")]
