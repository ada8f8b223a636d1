"""Issue 33, the first hour of a new user: what a new user meets on the README's commands behaves as they expect
(each test fails on the behaviour the issue measured). In-process and tiny, so that each runs well under a second."""
from __future__ import annotations

import pytest

from moe_lora_harness.harness.front.cli import main

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
               "fused_moe_lora", "--feature", "T*k < E", "--feature", "empty batch", "--cases-per-feature", "2",
               "--reruns", "0"])
    out = capsys.readouterr().out
    assert rc == 1
    assert out.count("NotImplementedError: not done yet") >= 1 and out.count("REPRO:") == 1, out
    assert "FAILURE GROUP 1 of 1: fused_moe_lora: 4 case(s), kind raised" in out, out
    assert "a plain function cannot declare them; wrap it in a BackendSpec" in out
    # the matrix and the summary end the output, after the failures
    assert out.index("REPRO:") < out.index("feature ") < out.index(" runs: ")


def test_a_failure_file_that_fuzz_writes_replays_as_it_is(tmp_path, capsys):
    import json

    from moe_lora_harness.harness.spec.case import Case
    from moe_lora_harness.harness.search.fuzz_report import FailureRecord
    from moe_lora_harness.harness.search.signatures import Signature
    case = Case.from_json('{"T":3,"layout":"naive"}')
    record = FailureRecord(Signature("element bound", (), ""), case, "element", "fail", 1.0, repro="REPRO", detail="x")
    f = tmp_path / "failure-01.json"
    f.write_text(json.dumps(record.to_json(), indent=1, sort_keys=True))
    assert main(["replay", "--only", "eager", "--device", "cpu", "--in-process", "--repeat", "1",
                 "--case", str(f)]) == 0
    assert "eager: pass" in capsys.readouterr().out


def test_a_layer_failure_file_replays_its_scenario_under_either_option(tmp_path):
    import json

    from moe_lora_harness.harness.front import cli
    from moe_lora_harness.harness.spec.case import Case
    from moe_lora_harness.harness.search.fuzz_report import FailureRecord
    from moe_lora_harness.harness.layer.layer_scenarios import layer_scenarios
    from moe_lora_harness.harness.search.signatures import Signature
    scenario = layer_scenarios("cpu")[0][1]
    record = FailureRecord(Signature("neutrality", (), ""), Case(), "untouched", "fail", 1.0, repro="R",
                           detail="x", scenario=scenario.to_json())
    f = tmp_path / "failure-01.json"
    f.write_text(json.dumps(record.to_json(), indent=1, sort_keys=True))
    assert cli._layer_failure_file(str(f))           # so `replay --case FILE` replays the scenario
    assert cli.read_scenario_arg(str(f)).to_json() == scenario.to_json()


ZERO_SIGN_OP = '''
from moe_lora_harness.reference.lora_op import fused_moe_lora as _ref

def fused_moe_lora(*args, **kwargs):
    _ref(*args, **kwargs, precision="one_shot")
    kwargs["output"].add_(0.0)      # always accumulating: -0.0 + 0.0 = +0.0 on rows the contract leaves alone
    if {changes_a_value}:
        kwargs["output"].view(-1)[0] += 1.0
'''


@pytest.mark.parametrize("changes_a_value", [False, True])
def test_an_op_that_only_flips_untouched_zeros_is_named_so(tmp_path, changes_a_value):
    from moe_lora_harness.harness.spec.case import Case
    from moe_lora_harness.harness.execution.execute import InProcess
    from moe_lora_harness.harness.spec.registry import load_ref
    from moe_lora_harness.harness.execution.runner import run_case
    f = tmp_path / "zero_sign_op.py"
    f.write_text(ZERO_SIGN_OP.format(changes_a_value=changes_a_value))
    [spec] = load_ref(f"{f}:fused_moe_lora")
    o = run_case(spec, Case.from_json('{"T":3,"mapping":"none"}'), "cpu", executor=InProcess(), reruns=0)
    assert o.status == "fail" and o.kind == "untouched", o.detail      # still a failure: bit for bit
    named = "only the sign of zero changed" in o.detail
    assert named != changes_a_value and (o.semantics == "sign-of-zero") == named, o.detail
    assert named != ("no semantic alternative" in o.detail), o.detail


def test_the_tp_degrees_listed_are_every_one_that_runs_and_docs_models_agrees():
    import pathlib

    from moe_lora_harness.harness.served.models import MODELS, case_fields, model_named
    qwen = model_named("qwen3-30b-a3b")
    assert case_fields(qwen, tp=3)["I"] == 256                      # --tp 3 runs ...
    with pytest.raises(ValueError, match=r"TP degrees that do: 1, 2, 3, 4, 6, 8, 12, 16$"):
        case_fields(qwen, tp=5)                                     # ... so --tp 5's error lists it
    docs = pathlib.Path(__file__).resolve().parents[2] / "docs" / "models.md"
    if not docs.is_file():
        pytest.skip("docs/ is in the source tree, not in an installed package")
    catalogue = docs.read_text().split("| model | H |", 1)[1].split("\n\n", 1)[0]     # the first table
    rows = {line.split(" | ")[0].strip("| "): line.rstrip(" |").split(" | ")[-2:]
            for line in catalogue.splitlines() if line.startswith("| ")}
    for m in MODELS:
        assert rows[m.name] == [",".join(map(str, m.tp_degrees())), ",".join(map(str, m.ep_degrees()))], m.name


def test_a_zero_budget_is_a_usage_error_naming_it(capsys):
    assert main(["fuzz", "--only", "eager", "--level", "op", "--budget", "0s"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--budget" in err and "positive duration" in err, err


def test_a_closed_pipe_ends_the_listing_quietly(monkeypatch):
    class Closed:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass
    monkeypatch.setattr("sys.stdout", Closed())
    assert main(["models", "--sources"]) == 141                    # `models --sources | head`: no traceback


def test_the_fuzz_corpus_of_another_file_with_the_same_name_is_its_own():
    from moe_lora_harness.harness.draw.cache import fuzz_corpus_dir
    a = fuzz_corpus_dir("fused_moe_lora", "/home/a/op.py:fused_moe_lora", "op")
    b = fuzz_corpus_dir("fused_moe_lora", "/home/b/op.py:fused_moe_lora", "op")
    assert a != b and a.name.startswith("fused_moe_lora-op-") and a == fuzz_corpus_dir(
        "fused_moe_lora", "/home/a/op.py:fused_moe_lora", "op")


def test_junit_records_each_cells_time():
    from moe_lora_harness.harness.spec.case import Case
    from moe_lora_harness.harness.check.report import build_matrix, matrix_junit_cases, to_junit
    from moe_lora_harness.harness.execution.runner import Outcome
    outcomes = [Outcome("b", Case(), "cpu", "pass", seconds=0.25), Outcome("b", Case(T=4), "cpu", "pass", seconds=0.5)]
    xml = to_junit("check", matrix_junit_cases(build_matrix(outcomes, lambda o: "fp16")))
    assert 'name="fp16" time="0.750"' in xml, xml


def test_the_top_level_help_names_every_command_and_level():
    from moe_lora_harness.harness.front.cli import build_parser
    from moe_lora_harness.harness.selftest.selftest import CORPORA
    text = build_parser().format_help()
    assert "adapter verify" in text and "--level op|expert|layer" in text, text
    assert all(c.name in text.split("--corpus ", 1)[1].split("]", 1)[0].split("|") for c in CORPORA), text


def test_a_replay_keeps_the_runs_timeout():
    from moe_lora_harness.harness.spec.case import Case
    from moe_lora_harness.harness.spec.registry import available_backends
    from moe_lora_harness.harness.execution.runner import repro_command
    from moe_lora_harness.harness.execution.worker import DEFAULT_TIMEOUT
    eager = available_backends()["eager"]
    assert " --timeout 2 " in repro_command(eager, Case(), "cpu", 2.0)       # a hang at 2 s replays as one
    assert "--timeout" not in repro_command(eager, Case(), "cpu", DEFAULT_TIMEOUT)


def test_the_readme_lists_every_selftest_corpus_and_what_ci_runs():
    import pathlib

    from moe_lora_harness.harness.selftest.selftest import CORPORA
    readme = pathlib.Path(__file__).resolve().parents[2] / "README.md"
    if not readme.is_file():
        pytest.skip("README.md is in the source tree, not in an installed package")
    para = readme.read_text().split("**Selftest.**", 1)[1].split("\n\n", 1)[0]
    listed = para.split("corpus of the project (", 1)[1].split(":", 1)[0]
    assert [n.strip() for n in listed.split(",")] == [c.name for c in CORPORA], listed
    assert "selftest --corpus tp --quick" in para, para


def test_hypothesis_keeps_its_files_in_our_cache_not_the_working_directory(tmp_path, monkeypatch):
    from hypothesis.configuration import storage_directory

    from moe_lora_harness.harness.draw import strategies  # noqa: F401 - configures hypothesis for our runs
    from moe_lora_harness.harness.draw.cache import CACHE_ENV, keep_hypothesis_files_here
    where = storage_directory("constants")
    assert ".hypothesis" not in str(getattr(where, "path", where))        # at import already
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv("HYPOTHESIS_STORAGE_DIRECTORY", raising=False)
    keep_hypothesis_files_here()
    where = storage_directory("constants")
    assert str(getattr(where, "path", where)).startswith(str(tmp_path))


def test_check_shows_a_live_line_on_a_terminal_and_each_backends_time_once(capsys, monkeypatch):
    import sys
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["check", "--in-process", "--device", "cpu", "--only", "eager", "--feature", "empty batch",
                 "--feature", "T*k < E", "--cases-per-feature", "1"]) == 0
    err = capsys.readouterr().err
    assert "\r[check] 0/2 runs, 0 failed, 0s | eager: " in err, err            # rows done / planned, failures
    assert err.count("[time per backend: eager ") == 1, err


def test_the_live_line_says_the_time_left():
    import io

    from moe_lora_harness.harness.check.check_progress import CheckProgress
    from moe_lora_harness.harness.execution.runner import Outcome
    out = io.StringIO()
    p = CheckProgress(planned=4, live=True, stream=out, every_s=0.0)
    p.finished(Outcome("eager", None, "cpu", "fail"), 1.0)
    p.start("eager", "rank 1")
    assert "1/4 runs, 1 failed" in out.getvalue() and " left | eager: rank 1" in out.getvalue(), out.getvalue()
    assert p.close() == "[time per backend: eager 1.0s]"


def test_the_matrix_fits_the_terminal_and_explains_its_marks():
    from moe_lora_harness.harness.check.report import to_text
    cell = {"status": "pass", "counts": {"pass": 2}, "reason": "", "probed_failing": {}}
    matrix = {f"backend_number_{i}": ({"fp16": cell} if i % 2 else {"experts: silu": cell}) for i in range(20)}
    text = to_text(matrix, ["fp16", "experts: silu"], width=100)
    assert max(len(line) for line in text.splitlines()) <= 100, text
    assert all(f"backend_number_{i}" in text for i in range(20))
    assert "-: not run for that backend" in text, text


def test_adapter_verify_reads_a_deepseek_v3_config_without_scoring_func():
    from moe_lora_harness.harness.served.models import layer_from_config, model_named, to_config
    d = to_config(model_named("deepseek-v3"))
    del d["scoring_func"]                     # transformers' DeepseekV3Config writes none: its router is a sigmoid
    assert layer_from_config(d).scoring == "sigmoid"


def test_adapter_verify_says_when_the_adapter_was_made_for_another_model():
    from moe_lora_harness.harness.served.adapter_verify import base_model_note
    gpt_oss = {"auto_mapping": {"base_model_class": "GptOssForCausalLM",
                                "parent_library": "transformers.models.gpt_oss.modeling_gpt_oss"}}
    assert "GptOssForCausalLM" in base_model_note(gpt_oss, "qwen3_moe")
    assert base_model_note(gpt_oss, "gpt_oss") == "" and base_model_note({"auto_mapping": None}, "qwen3_moe") == ""


def test_a_truncated_adapter_file_is_an_error_naming_it(tmp_path):
    pytest.importorskip("safetensors")
    import torch
    from safetensors.torch import save_file

    from moe_lora_harness.harness.served.peft_adapters import AdapterFileError, read_folder
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    w = tmp_path / "adapter_model.safetensors"
    save_file({"x": torch.zeros(64, 64)}, str(w))
    w.write_bytes(w.read_bytes()[:1000])                     # a download cut short
    with pytest.raises(AdapterFileError, match="adapter_model.safetensors'?: not a readable safetensors file"):
        read_folder(tmp_path)


def test_a_run_of_our_suites_alone_keeps_pytests_cache_out_of_the_working_directory(tmp_path, monkeypatch):
    import pathlib
    from types import SimpleNamespace

    from moe_lora_harness.harness.draw.cache import CACHE_ENV
    from moe_lora_harness.harness.front.pytest_plugin import keep_pytest_cache_out_of_the_working_directory
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))

    def session(args, inipath=None):
        config = SimpleNamespace(cache=SimpleNamespace(_cachedir=pathlib.Path(".pytest_cache")), inipath=inipath,
                                 args=args, option=SimpleNamespace(pyargs=True))
        keep_pytest_cache_out_of_the_working_directory(config)
        return config.cache._cachedir
    assert session(["moe_lora_harness.suites.conformance"]) == tmp_path / "pytest-cache"
    assert session(["tests/"]) == pathlib.Path(".pytest_cache")                         # the user's own tests
    assert session(["moe_lora_harness.suites"], inipath="pytest.ini") == pathlib.Path(".pytest_cache")


def test_two_named_mistakes_of_one_backend_are_two_groups():
    from moe_lora_harness.harness.spec.case import Case
    from moe_lora_harness.harness.check.failure_groups import group_failures
    from moe_lora_harness.harness.execution.runner import Outcome

    def fail(semantics, ratio):
        return Outcome("b", Case(), "cpu", "fail", kind="element", semantics=semantics,
                       message=f"3 element(s) exceed the per-element bound (worst {ratio}x)")
    groups = group_failures([fail("no-lora", 2.5), fail("no-lora", 7.0), fail("w2-delta-missing", 3.0)],
                            lambda o: "fp16")
    assert [len(g.outcomes) for g in groups] == [2, 1]


def test_a_cell_that_passes_still_says_why_some_of_its_cases_were_not_run():
    """A cell "pass 4/6 (2 not runnable here)" (check --model at DeepSeek-V3 on the H200: fp32 needs more memory than
    the GPU has) says why, and which cases: in the text beside the cell's feature, and in the JSON."""
    from moe_lora_harness.harness.check.report import build_matrix, to_text
    from moe_lora_harness.harness.execution.runner import Outcome
    from moe_lora_harness.harness.spec.case import Case
    ran, big = Case(T=3), Case(T=3, dtype="float32")
    why = "not runnable on this machine: T=3 float32 needs 160 GiB; 139 GiB free GPU memory on cuda"
    matrix = build_matrix([Outcome("b", ran, "cuda", "pass"), Outcome("b", big, "cuda", "not-runnable", why)],
                          lambda _: "experts: fp32")
    c = matrix["b"]["experts: fp32"]
    assert c["status"] == "pass" and c["no_verdict"] == [{"status": "not-runnable", "reason": why,
                                                          "cases": [big.to_json()]}]
    text = to_text(matrix, ["experts: fp32"], width=200)
    assert "pass 1/2 (1 not runnable here)" in text
    assert "not runnable on this machine:\n  b / experts: fp32: " + why in text
