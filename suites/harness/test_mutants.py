"""The harness catches each class of planted bug, with a REPRO line, and passes the control."""
from __future__ import annotations

import pytest

from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.registry import harness_command, load_ref
from moe_lora_harness.harness.execution.runner import run_case

MUTANTS = load_ref("moe_lora_harness.harness.selftest.mutants:MUTANTS")   # as a user loads them (origin set)
BY_NAME = {m.name: m for m in MUTANTS}
BASE = Case(T=6, H=48, I=40, E=4, top_k=2, max_loras=3, max_rank=8, seed=7)
W2 = dict(which="w2", num_slices=1, mul_routed_weight=True)
TP_FS = Case(level="expert", T=5, H=32, I=32, E=4, top_k=2, max_loras=2, max_rank=8, tp_size=2, fully_sharded=True,
             seed=7)

# mutant -> a case on which its defect must show
EXPOSING = {
    "bf16-operands": BASE.replace(dtype="float16", T=12, H=96),
    "drops-slice": BASE,
    "ignores-routed-weight": BASE.replace(**W2),
    "ignores-adapter-enabled": BASE.replace(mapping="disabled", layout="naive"),
    "no-adapter-as-slot0": BASE.replace(mapping="mixed", layout="naive"),
    "truncates-rank": BASE,
    "clobbers-offset": BASE.replace(**W2, offset=5),
    "skips-write-add-inputs-false": BASE.replace(add_inputs=False),
    "wrong-x-row": BASE.replace(**W2),
    "skips-last-active-lora": BASE.replace(active_loras="unique"),
    "tp-w2-offset-zero": TP_FS,
    "tp-skips-lora-collectives": TP_FS,
    "tp-w2-delta-rank0-only": TP_FS.replace(fully_sharded=False),
}


@pytest.mark.parametrize("name", sorted(EXPOSING))
def test_mutant_is_caught(name):
    out = run_case(BY_NAME[f"mutant-{name}"], EXPOSING[name], "cpu")
    assert out.status == "fail", f"planted bug {name} was not caught: {out.status} {out.reason}"
    assert "\nREPRO: " in out.detail and f"{harness_command()} replay" in out.detail and "CASE: {" in out.detail


@pytest.mark.parametrize("case", [c for c in EXPOSING.values() if c.level == "op"] + [BASE.replace(dtype="float32")],
                         ids=lambda c: c.id)
def test_control_passes(case):
    out = run_case(BY_NAME["mutant-control"], case, "cpu")
    assert out.status == "pass", out.detail


@pytest.mark.parametrize("case", [TP_FS, TP_FS.replace(fully_sharded=False), TP_FS.replace(tp_size=4, I=64, H=64),
                                  TP_FS.replace(activation="swigluoai", bias=True, mapping="mixed", dtype="float32")],
                         ids=lambda c: c.id)
def test_expert_control_passes_on_simulated_tp_ranks(case):
    """One TP rank's reference forward per simulated rank, joined and all-reduced, matches the sharded reference."""
    out = run_case(BY_NAME["mutant-experts-control"], case, "cpu")
    assert out.status == "pass", out.detail


def test_the_last_active_lora_bug_hides_at_the_default_count_and_shows_when_specialized():
    """Why active_loras is drawn: at num_active_loras = L+1 the skipped last entry is -1 padding (BASE's
    mapping uses each of its 3 slots and no -1), so the off-by-one passes; specialized, it drops a slot."""
    spec = BY_NAME["mutant-skips-last-active-lora"]
    assert run_case(spec, BASE, "cpu").status == "pass"
    assert run_case(spec, BASE.replace(active_loras="unique"), "cpu").status == "fail"
    assert run_case(BY_NAME["mutant-control"], BASE.replace(active_loras="unique"), "cpu").status == "pass"


def test_every_mutant_has_an_exposing_case():
    assert set(EXPOSING) == {m.name.removeprefix("mutant-") for m in MUTANTS} - {"control", "experts-control"}


def test_repro_line_replays_the_failure_alone():
    """The REPRO command, run as printed, loads the same backend and fails the same way."""
    import shlex
    from moe_lora_harness.harness.front.cli import main
    out = run_case(BY_NAME["mutant-wrong-x-row"], EXPOSING["wrong-x-row"], "cpu")
    line = next(l for l in out.detail.splitlines() if l.startswith("REPRO: "))
    argv = shlex.split(line.removeprefix("REPRO: "))
    while "=" in argv[0]:    # PYTHONPATH=..., where a fresh shell could not import the package
        argv.pop(0)
    cmd = shlex.split(harness_command())     # the console script, or python -m in a source tree not installed
    assert argv[:len(cmd)] == cmd and "--backend" in argv
    assert main(argv[len(cmd):]) == 1
