"""Issue 33, the first hour of a new user: what a new user meets on the README's commands behaves as they expect
(each test fails on the behaviour the issue measured). In-process and tiny, so that each runs well under a second."""
from __future__ import annotations

import pytest

from moe_lora_harness.harness.cli import main

RAISER = '''
def fused_moe_lora(*args, **kwargs):
    raise NotImplementedError("not done yet")
'''


def test_a_backend_without_a_case_of_the_selected_features_is_not_in_the_run(capsys):
    # a layer backend has no case of an op feature: it is not part of the run, not NOTHING TESTED (exit 1)
    rc = main(["check", "--in-process", "--device", "cpu", "--only", "eager", "--only", "layer_triton",
               "--feature", "empty batch", "--cases-per-feature", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "NOTHING TESTED" not in out and "not in this run" in out and "layer_triton" in out


def test_repeated_failures_print_once_with_a_count_and_how_to_declare_a_limit(tmp_path, capsys):
    f = tmp_path / "raiser.py"
    f.write_text(RAISER)
    rc = main(["check", "--in-process", "--device", "cpu", "--backend", f"{f}:fused_moe_lora", "--only",
               "fused_moe_lora", "--feature", "rank", "--cases-per-feature", "2", "--reruns", "0"])
    out = capsys.readouterr().out
    assert rc == 1
    assert out.count("NotImplementedError: not done yet") >= 1 and out.count("REPRO:") == 1, out
    assert "FAILURE GROUP 1 of 1: fused_moe_lora: 8 case(s), kind raised" in out, out
    assert "a plain function cannot declare them; wrap it in a BackendSpec" in out
    # the matrix and the summary end the output, after the failures
    assert out.index("REPRO:") < out.index("feature ") < out.index(" runs: ")
