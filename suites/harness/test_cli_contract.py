"""The command line and the registry as a new user meets them: usage errors, names, REPROs that replay.

Usage errors are one line and exit 2; a backend is named by its short name and replayed from any
directory of a fresh shell; a function is inspected, never called, to learn what it is.
"""
from __future__ import annotations

import os
import pathlib
import shlex
import subprocess
import sys
import textwrap

import pytest

from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.registry import BackendLoadError, harness_command, load_ref, select
from moe_lora_harness.harness.execution.runner import repro_command, run_case

ROOT = pathlib.Path(__file__).resolve().parents[2]
IN_SOURCE_TREE = (ROOT / "pyproject.toml").is_file()

WRONG_OP = '''
from moe_lora_harness.reference.lora_op import fused_moe_lora as _ref
calls = []

def {name}(*args, **kwargs):
    calls.append(1)
    _ref(*args, **kwargs, precision="one_shot")
    kwargs["output"].mul_(1.5)      # planted: 1.5x the right answer
'''


def _cli(*args, cwd=None, timeout=600):
    import moe_lora_harness
    parent = os.path.dirname(os.path.dirname(os.path.abspath(moe_lora_harness.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([parent, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return subprocess.run([sys.executable, "-m", "moe_lora_harness", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


@pytest.mark.parametrize("argv, text", [
    (["check", "--device", "gpu"], "expected cpu, cuda or cuda:N; got 'gpu'"),
    (["fuzz", "--only", "eager", "--level", "kernel"], "invalid choice: 'kernel'"),
    (["replay", "--only", "eager", "--case", '{"E": 2, "top_k": 3}'], "malformed case: top_k (3) must be <= E (2)"),
    (["replay", "--only", "eager", "--case", '{"T": 3'], "not valid JSON"),
    (["check", "--only", "nosuchbackend"], "no such backend"),
    (["check", "--backend", "no_colon"], "expected 'module:attr'"),
    (["check", "--timeout", "0"], "expected a positive number"),
    (["fuzz", "--only", "eager"], "provides the op, expert levels: pass --level op or --level expert"),
    (["fuzz", "--only", "triton_experts", "--level", "op"], "provides no op-level entry point"),
])
def test_usage_errors_are_one_line_and_exit_2(argv, text, capsys):
    from moe_lora_harness.harness.front.cli import main
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and text in lines[0], err
    assert lines[0].startswith("moe-lora-harness")


def test_a_usage_error_from_the_command_line_is_exit_2():
    out = _cli("check", "--device", "gpu")
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr


def test_fuzz_picks_the_level_the_backend_provides():
    out = _cli("fuzz", "--only", "triton_experts", "--max-examples", "2", "--seed", "1", "--no-db")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "2 expert-level examples" in out.stdout and "0 distinct failure(s); stopped: examples" in out.stdout


def test_nothing_tested_is_not_a_pass():
    out = _cli("check", "--only", "gated_fast_experts", "--feature", "experts: gelu", "--cases-per-feature", "1")
    assert out.returncode == 1 and "NOTHING TESTED: gated_fast_experts" in out.stdout, out.stdout[-2000:]


def test_a_varargs_wrapper_is_inspected_not_called(tmp_path):
    (tmp_path / "wrapmod.py").write_text(WRONG_OP.format(name="my_op"))
    sys.path.insert(0, str(tmp_path))
    try:
        [spec] = load_ref("wrapmod:my_op")
        import wrapmod
        assert wrapmod.calls == [] and spec.name == "my_op" and spec.origin == "wrapmod:my_op"
        assert spec.capabilities.levels == {"op"}
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("wrapmod", None)


@pytest.mark.parametrize("source, attr, text", [
    ("def factory():\n    return None\n", "factory", "expected a BackendSpec"),   # no factories: never called
    ("class MyExperts:\n    pass\n", "MyExperts", "spec_for"),
    ("X = []\n", "X", "non-empty list"),
])
def test_what_is_not_a_backend_says_so(tmp_path, source, attr, text):
    f = tmp_path / "notabackend.py"
    f.write_text(source)
    with pytest.raises(BackendLoadError, match=text):
        load_ref(f"{f}:{attr}")


def test_a_file_backend_gets_its_short_name_and_only_accepts_either(tmp_path):
    f = tmp_path / "myop.py"
    f.write_text(WRONG_OP.format(name="fused_moe_lora"))
    specs = {s.name: s for s in load_ref(f"{f}:fused_moe_lora")}
    assert list(specs) == ["fused_moe_lora"] and specs["fused_moe_lora"].origin == f"{f}:fused_moe_lora"
    assert select(specs, ["fused_moe_lora"]) == select(specs, [f"{f}:fused_moe_lora"]) == specs


@pytest.mark.starts_first
def test_repro_of_a_module_backend_replays_from_a_fresh_shell_elsewhere(tmp_path):
    """`--backend mymod:attr` found through the working directory: the REPRO carries its PYTHONPATH."""
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    (tmp_path / "mymod.py").write_text(WRONG_OP.format(name="my_op"))
    out = _cli("replay", "--backend", "mymod:my_op", "--only", "my_op", "--device", "cpu", "--case",
               '{"T": 3, "seed": 2}', cwd=tmp_path)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    repro = next(l for l in out.stdout.splitlines() if l.startswith("REPRO: ")).removeprefix("REPRO: ")
    env, *command = shlex.split(repro)
    # the module's folder first (then, in a source tree that is not installed, the package's own)
    assert env.startswith("PYTHONPATH=") and env.removeprefix("PYTHONPATH=").split(os.pathsep)[0] == str(tmp_path)
    cmd = shlex.split(harness_command())
    assert command[:len(cmd) + 3] == cmd + ["replay", "--backend", "mymod:my_op"], repro
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = path
    again = subprocess.run(["bash", "-c", repro], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 1 and "FAIL backend=my_op" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]


def test_a_third_party_experts_spec_replays_from_its_own_module(tmp_path):
    (tmp_path / "myexperts.py").write_text(textwrap.dedent("""
        from moe_lora_harness.backends.experts import spec_for
        from moe_lora_harness.kernels.experts.triton_experts import TritonExperts

        class MyExperts(TritonExperts):
            name = "my_experts"

        SPEC = spec_for(MyExperts, "a third party's experts class")
    """))
    sys.path.insert(0, str(tmp_path))
    try:
        [spec] = load_ref("myexperts:SPEC")
        line = repro_command(spec, Case(level="expert", T=2), "cpu")
        assert "--backend myexperts:SPEC --only my_experts" in line and "backends.experts" not in line
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("myexperts", None)


def test_builtins_need_no_backend_argument_to_replay():
    [spec] = [s for s in load_ref("moe_lora_harness.backends:BUILTINS") if s.name == "eager"]
    line = repro_command(spec, Case(T=2), "cpu")
    assert "--backend" not in line and f"{harness_command()} replay --only eager --device cpu --case " in line


@pytest.mark.skipif(not IN_SOURCE_TREE, reason="pyproject.toml is in the source repository only")
def test_one_registration_list_and_one_namespace():
    """One entry point registers our backends, one the plugin; the packages are discovered under src/, never
    listed by hand."""
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")   # the test extra has tomli

    from moe_lora_harness.harness.spec import registry
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    eps = meta["project"]["entry-points"]
    assert eps["moe_lora_harness.backends"] == {"builtin": registry.BUILTIN_REF}
    assert eps["pytest11"] == {"moe_lora_harness": "moe_lora_harness.harness.front.pytest_plugin"}
    setup = meta["tool"]["setuptools"]
    assert setup["packages"] == {"find": {"where": ["src"]}}, "packages are discovered under src/, not listed"
    assert "package-dir" not in setup


def test_a_backend_that_claims_everything_is_not_hurt_by_a_malformed_case():
    with pytest.raises(ValueError, match="malformed case"):
        run_case(load_ref("moe_lora_harness.backends:BUILTINS")[0], Case(T=-1), "cpu")


def test_check_says_which_backends_are_judged_as_rounding_anywhere(capsys):
    """A backend without a model_points_only declaration for the device is judged with rules 3 and 4's allowance for
    rounding at other points, and check says so (a NOTE naming the declaration); a declared one gets no note."""
    from moe_lora_harness.harness.front import cli
    stranger = "moe_lora_harness.suites.harness.stranger_backends:TRANSFORMERS_STYLE"
    rc = cli.main(["check", "--in-process", "--device", "cpu", "--backend", stranger, "--only",
                   "transformers_style_experts", "--only", "eager", "--feature", "experts: silu",
                   "--cases-per-feature", "1", "-q"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "NOTE transformers_style_experts is judged as a kernel that may round where its model does not" in out, out
    assert "model_points_only" in out and "NOTE eager is judged" not in out, out


def test_check_counts_the_runs_whose_rows_rule_4_could_not_judge(capsys, tmp_path):
    """A decode row's calls pool too few rows on the CPU profile for rule 4 (or its one-expert sets are small): check
    says in how many passing runs rules 2 and 3 alone judged some rows, and each cell's JSON counts them."""
    import json
    from moe_lora_harness.harness.front import cli
    report = tmp_path / "check.json"
    rc = cli.main(["check", "--in-process", "--device", "cpu", "--only", "eager", "--feature", "decode calls",
                   "--cases-per-feature", "1", "-q", "--json", str(report)])
    out = capsys.readouterr().out
    assert rc == 0, out
    cells = json.loads(report.read_text())["matrix"]["eager"]
    (cell,) = cells.values()
    assert cell["rule4_unseen"] == cell["counts"]["pass"] >= 1, cell
    assert f"NOTE in {cell['rule4_unseen']} of {cell['counts']['pass']} passing runs some rows were beyond rule 4" in out, out


def test_check_says_whose_fp8_runs_on_a_gpu_kept_the_worst_case_accumulation_term(monkeypatch):
    """On a GPU an FP8 run of a backend whose accumulation the judge does not model there (no BackendSpec.fp8_mma,
    or a case it does not emulate) is judged with the worst-case term, and check names that backend; a declared one,
    a non-FP8 run and a CPU run are not named."""
    import dataclasses

    import torch
    from moe_lora_harness.harness.execution.runner import Outcome
    from moe_lora_harness.harness.front import cli
    from moe_lora_harness.harness.spec.registry import available_backends
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    specs = {n: s for n, s in available_backends().items() if n in ("eager", "triton_experts")}
    fp8 = Case(level="expert", quant="fp8_w8a8", dtype="bfloat16", H=256, I=256, E=4, T=8)
    runs = [Outcome(name, case, "cuda:0", "pass") for name in specs for case in (fp8, fp8.replace(quant="none"))]
    assert cli._fp8_at_worst_case(specs, runs, "cuda:0") == ["eager"]
    assert cli._fp8_at_worst_case(specs, [Outcome("triton_experts", fp8.replace(view="reordered"), "cuda:0", "pass")],
                                  "cuda:0") == ["triton_experts"]
    assert cli._fp8_at_worst_case(specs, runs, "cpu") == []

    def broken(case):
        raise KeyError("no tile")
    raising = {"triton_experts": dataclasses.replace(specs["triton_experts"], fp8_mma={"cuda": broken})}
    failed = Outcome("triton_experts", fp8, "cuda:0", "fail", kind="declaration")   # its own failure, said already
    assert cli._fp8_at_worst_case(raising, [failed], "cuda:0") == []
