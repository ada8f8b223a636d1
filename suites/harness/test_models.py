"""The catalogue of served MoE layers, its config.json parser, and `check --model`'s plan.

Records are consistent (divisibility as claimed, activations the reference knows, a source for every number);
the parser reads back a record written as each family's config.json and names the key a broken file lacks;
a feature runs at a layer iff it leaves the layer's shape alone (checked both ways); the TP / EP slices; a case
too large for the memory budget is refused with the bytes it needs; and `check --model-config` end to end.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from moe_lora_harness.harness.build.builders import build_expert_inputs, build_op_inputs
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.build.case_memory import FIXED, INPUT_COPIES, memory_need
from moe_lora_harness.harness.check.features import FEATURES
from moe_lora_harness.harness.check.model_plan import (
    NOT_APPLICABLE,
    applicability,
    fixed_fields,
    layer_shapes,
    plan_model,
)
from moe_lora_harness.harness.served.models import (
    EP_DEGREES,
    MODELS,
    TP_DEGREES,
    ConfigError,
    case_fields,
    layer_from_config,
    model_named,
    to_config,
)
from moe_lora_harness.harness.draw.profiles import shapes_for
from moe_lora_harness.harness.spec.registry import available_backends, select
from moe_lora_harness.reference.activations import ACTIVATIONS, SUPPORTED_ACTIVATIONS

NUMBERS = ("H", "I", "E", "top_k", "activation", "bias", "scoring", "renormalize", "correction_bias", "n_group",
           "topk_group", "routed_scaling_factor", "shared_experts", "shared_I", "quant")
EXPERT_KEY = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts", "gpt_oss": "num_local_experts",
              "deepseek_v3": "n_routed_experts", "nemotron_h": "n_routed_experts"}
# a user's layer of a few tens of dims (Qwen3-MoE's layout)
TINY = {"model_type": "qwen3_moe", "hidden_size": 32, "moe_intermediate_size": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "hidden_act": "silu", "torch_dtype": "bfloat16"}


def _eager():
    return select(available_backends(), ["eager"])


# ---------------------------------------------------------------- the catalogue

def test_the_catalogue_holds_the_served_families():
    names = {m.name for m in MODELS}
    assert {"qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "mixtral-8x22b", "gpt-oss-20b", "gpt-oss-120b",
            "deepseek-v3", "nemotron-3-nano-30b-a3b"} <= names
    assert {m.model_type for m in MODELS} == set(EXPERT_KEY)
    nemotron, oss, dsv3 = model_named("nemotron-3-nano-30b-a3b"), model_named("GPT-OSS-20B"), model_named("deepseek-v3")
    assert not nemotron.gated and nemotron.shared_experts == 1 and nemotron.scoring == "sigmoid"
    assert oss.interleaved and oss.bias and oss.quant == "mxfp4" and oss.activation_limit == 7.0
    assert dsv3.quant == "fp8_e4m3 block 128x128" and dsv3.correction_bias and (dsv3.n_group, dsv3.topk_group) == (8, 4)
    assert all(m.gated and not m.bias for m in MODELS if m.model_type in ("qwen3_moe", "mixtral", "deepseek_v3"))
    with pytest.raises(ValueError, match="no such model.*qwen3-30b-a3b"):
        model_named("qwen4")


@pytest.mark.parametrize("m", MODELS, ids=lambda m: m.name)
def test_a_record_is_consistent_and_sourced(m):
    assert m.activation in SUPPORTED_ACTIVATIONS and m.gated == ACTIVATIONS[m.activation].gated
    assert 1 <= m.top_k <= m.E and m.E % m.n_group == 0 and m.topk_group <= m.n_group
    assert (m.shared_I == 0) == (m.shared_experts == 0)
    # the degrees listed divide, the others do not (both ways)
    assert all(m.I % tp == 0 for tp in m.tp_degrees()) and all(m.I % tp for tp in set(TP_DEGREES) - set(m.tp_degrees()))
    assert all(m.E % ep == 0 for ep in m.ep_degrees())
    assert all(m.E % ep or ep > m.E for ep in set(EP_DEGREES) - set(m.ep_degrees()))
    # every number has a source: a config key or a named family rule; the file and the copy read are named
    assert m.unsourced == ()
    assert all(m.source(f) for f in NUMBERS), [f for f in NUMBERS if not m.source(f)]
    assert m.config_url.startswith("https://huggingface.co/") and m.config_url.endswith("/config.json")
    assert m.read_in and "TODO" not in m.read_in


def test_a_number_without_a_source_is_reported():
    """The check above can fail: a source-less field is listed as unsourced, and a rule's text is not a key."""
    m = model_named("qwen3-30b-a3b")
    assert m.source("I") == "config.json key 'moe_intermediate_size'"
    assert m.source("scoring").startswith("not a config key")
    bare = dataclasses.replace(m, sources=tuple(s for s in m.sources if s[0] != "E"))
    assert not bare.source("E")


# ---------------------------------------------------------------- the parser

@pytest.mark.parametrize("m", MODELS, ids=lambda m: m.name)
def test_a_record_written_as_its_familys_config_reads_back(m, tmp_path):
    config = to_config(m)
    assert EXPERT_KEY[m.model_type] in config
    (tmp_path / "config.json").write_text(json.dumps(config))
    keep = dict(name=m.name, hf_repo=m.hf_repo, read_in=m.read_in, note=m.note)
    for source in (config, tmp_path / "config.json", tmp_path):     # a dict, a file, a folder holding one
        again = layer_from_config(source, **keep)
        assert dataclasses.replace(again, sources=()) == dataclasses.replace(m, sources=())


@pytest.mark.parametrize("m", MODELS, ids=lambda m: m.name)
def test_a_config_without_its_expert_count_names_the_key(m):
    config = to_config(m)
    del config[EXPERT_KEY[m.model_type]]
    with pytest.raises(ConfigError, match=f"missing key '{EXPERT_KEY[m.model_type]}'"):
        layer_from_config(config)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("model_type"), "missing key 'model_type'"),
    (lambda d: d.update(model_type="llama"), "'model_type' = 'llama' is not a known MoE family"),
    (lambda d: d.update(num_experts="128"), "key 'num_experts' must be an integer >= 1"),
    (lambda d: d.update(hidden_act="tanh"), "key 'hidden_act' = 'tanh'"),
    (lambda d: d.pop("norm_topk_prob"), "missing key 'norm_topk_prob'"),
    (lambda d: d.update(num_experts_per_tok=9), "top_k 9 exceeds the expert count 8"),
    (lambda d: d.pop("torch_dtype"), "missing key 'quantization_config', 'dtype' or 'torch_dtype'"),
])
def test_a_broken_config_is_a_clear_error(change, message):
    config = dict(TINY)
    layer_from_config(config)                 # the unbroken file reads
    change(config)
    with pytest.raises(ConfigError, match=message):
        layer_from_config(config)


def test_a_qwen3_config_saved_by_transformers_5_reads_too():
    """transformers 5 writes Qwen3-MoE's expert count as num_local_experts; the source names the key read."""
    config = {k: v for k, v in TINY.items() if k != "num_experts"}
    layer = layer_from_config(dict(config, num_local_experts=8, dtype="bfloat16"))
    assert layer.E == 8 and layer.source("E") == "config.json key 'num_local_experts'"


def test_a_file_that_is_not_a_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        layer_from_config(tmp_path)
    with pytest.raises(ConfigError, match="neither a config.json file nor a folder"):
        layer_from_config(tmp_path / "missing.json")
    oss = to_config(model_named("gpt-oss-20b"))
    with pytest.raises(ConfigError, match="swiglu_limit.*clamps at 7"):
        layer_from_config(dict(oss, swiglu_limit=8.0))


# ---------------------------------------------------------------- the plan

@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "nemotron-3-nano-30b-a3b", "gpt-oss-20b"])
def test_a_feature_applies_iff_it_leaves_the_layer_alone(name):
    layer = model_named(name)
    s = layer_shapes(layer, "cpu")
    for feat in FEATURES:
        made = feat.make(s)
        fixed = fixed_fields(layer, 1, 1, made.get("which", "w13"))
        changes = {k for k in made if k in fixed and made[k] != fixed[k]}
        why = applicability(feat, layer, s)
        if changes:                                  # about another layer: says which fields, never runs
            assert why.startswith("sets ") and all(f"{k}=" in why for k in changes), (feat.name, why)
        elif why:                                    # otherwise only a feature about a token count is n/a
            assert "token count" in why and set(made) | set(feat.per_case(s, 0) if feat.per_case else {}) <= {
                "T", "dtype"}, (feat.name, why)


def test_the_plan_keeps_the_shape_and_gives_every_feature_a_row():
    layer, tokens = layer_from_config(TINY, "tiny"), (1, 7, 4096 + 17)
    plan = plan_model(layer, _eager(), "cpu", FEATURES, tokens=tokens, budget=2**40)
    assert [r.removesuffix(NOT_APPLICABLE) for r in plan.rows] == [f.name for f in FEATURES]   # none dropped
    assert set(plan.not_applicable) == {r.removesuffix(NOT_APPLICABLE) for r in plan.rows if r.endswith(NOT_APPLICABLE)}
    ran = {feat for _, _, feat, _ in plan.runs}
    assert ran and not ran & set(plan.not_applicable) and not plan.prejudged
    fixed = case_fields(layer)
    dtypes = shapes_for("cpu").dtypes
    by_feature = {}
    for _, _, feat, case in plan.runs:
        assert all(getattr(case, k) == v for k, v in fixed.items()), (feat, case)
        assert case.per_call().T in tokens               # a decode row's calls hold one token count each
        by_feature.setdefault(feat, set()).add((case.T, case.dtype))
    assert by_feature["experts: silu"] == {(T, dt) for T in tokens for dt in dtypes}      # T x the profile's dtypes
    assert by_feature["experts: bf16"] == {(T, "bfloat16") for T in tokens}              # or the feature's dtype
    # derived, not listed: wide-tile rows apply at I = 128 k only; the non-gated row only to a non-gated layer
    assert "experts: I multiple of 128 (wide-tile paths)" in plan.not_applicable
    assert "experts: I multiple of 128 (wide-tile paths)" in ran_features(model_named("qwen3-30b-a3b"))
    assert "w13 one slice (non-gated)" in plan.not_applicable
    assert "w13 one slice (non-gated)" in ran_features(model_named("nemotron-3-nano-30b-a3b"))
    assert "experts: swigluoai" in ran_features(model_named("gpt-oss-120b"))


def ran_features(layer):
    return {feat for feat, why in ((f.name, applicability(f, layer, layer_shapes(layer, "cpu"))) for f in FEATURES)
            if not why}


def test_tp_and_ep_slices():
    q = model_named("qwen3-30b-a3b")
    f = case_fields(q, tp=4, ep=8)
    assert (f["I"], f["E"], f["ep_size"], f["ep_rank"], f["tp_size"]) == (768 // 4, 128, 8, 7, 1)
    plan = plan_model(layer_from_config(TINY), _eager(), "cpu", FEATURES, tp=2, ep=4, tokens=(3,), budget=2**40)
    for _, _, feat, case in plan.runs:
        assert (case.I, case.ep_size, case.ep_rank, case.local_experts) == (8, 4, 3, 2), feat
    expert_case = next(c for _, _, _, c in plan.runs if c.level == "expert")
    emap = build_expert_inputs(expert_case).expert_map
    assert emap.tolist() == [-1] * 6 + [0, 1]          # the last rank holds experts 6 and 7
    with pytest.raises(ValueError, match="--tp 5: .*I=768 does not divide"):
        case_fields(q, tp=5)
    with pytest.raises(ValueError, match="--ep 3: .*8 experts do not split evenly.*1, 2, 4, 8"):
        case_fields(model_named("mixtral-8x7b"), ep=3)


@pytest.mark.parametrize("argv, text", [
    (["check", "--model", "qwen3-30b-a3b", "--tp", "5"], "--tp 5"),
    (["check", "--model", "mixtral-8x7b", "--ep", "16"], "--ep 16"),
    (["check", "--model", "nosuch"], "no such model"),
    (["check", "--tp", "2"], "--tp needs --model or --model-config"),
    (["check", "--model", "deepseek-v3", "--tokens", "1,x"], "expected comma-separated token counts"),
    (["check", "--model", "deepseek-v3", "--more"], "do not apply with --model"),
    (["check", "--model", "deepseek-v3", "--model-config", "."], "not both"),
    (["fuzz", "--level", "expert", "--tokens", "7"], "--tokens needs --model or --model-config"),
    (["fuzz", "--level", "expert", "--model", "qwen3-30b-a3b", "--tp", "5"], "--tp 5"),
    (["fuzz", "--level", "op", "--model", "nosuch"], "no such model"),
])
def test_model_usage_errors_are_one_line(argv, text, capsys):
    from moe_lora_harness.harness.front.cli import main
    assert main(argv + ["--only", "eager", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and text in err, err


def test_a_broken_model_config_is_a_usage_error_naming_the_key(tmp_path, capsys):
    from moe_lora_harness.harness.front.cli import main
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in TINY.items() if k != "num_experts"}))
    assert main(["check", "--model-config", str(tmp_path), "--only", "eager", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--model-config" in err and "missing key 'num_experts'" in err, err


def test_models_lists_one_line_per_layer(capsys):
    from moe_lora_harness.harness.front.cli import main
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for m in MODELS:
        line = next(ln for ln in lines if ln.startswith(m.name + " "))
        assert f" {m.H} " in line and m.quant in line and ",".join(map(str, m.ep_degrees())) in line


# ---------------------------------------------------------------- memory

def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(_tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name != "case")
    return 0


@pytest.mark.parametrize("case", [
    Case(level="expert", T=9, H=64, I=48, E=6, top_k=2, dtype="float32"),
    Case(level="expert", T=5, H=40, I=24, E=4, top_k=2, activation="relu2_no_mul", bias=True),
    Case(level="op", T=7, H=64, I=48, E=4, top_k=2, which="w2", num_slices=1, mul_routed_weight=True),
], ids=["gated", "non-gated", "op-w2"])
def test_the_inputs_estimate_covers_what_the_builder_allocates(case):
    built = build_op_inputs(case) if case.level == "op" else build_expert_inputs(case)
    actual = _tensor_bytes(built)
    if case.level == "expert":     # and the output the worker allocates (ExpertInputs.call)
        actual += case.T * case.H * built.hidden.element_size()
    need = memory_need(case)
    assert actual <= need.inputs <= 2 * actual, (actual, need.inputs)


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's resettable peak RSS")
@pytest.mark.parametrize("case", [
    Case(level="op", T=1024, H=256, I=128, E=8, top_k=8, max_loras=3),
    Case(level="expert", T=1024, H=256, I=128, E=8, top_k=8, max_loras=3),
    # fp32: the judge runs a twin (its own truth and emulation, expectation.twin_own_truth); the runner's expectations
    Case(level="op", T=512, H=2048, I=256, E=8, top_k=4, max_loras=3, dtype="float32", which="w2", num_slices=1,
         mul_routed_weight=True),
], ids=["op", "expert", "op-twin"])
def test_the_estimate_covers_the_judges_measured_peak(case):
    """The judge's side of the estimate (its inputs, the float64 reference, FIXED) against its peak RSS while it
    builds the inputs and the expectations of a case whose pairs dominate: not under it, and not 3x over. Measured
    in a fresh process: in a test worker the peak moved with what the worker ran before (a CI run measured 951 MB
    against the estimate's 910 MB after other tests). And with glibc's mmap threshold fixed: its dynamic threshold
    (raised as large blocks are freed) served later large blocks from a fragmented heap, and the same computation
    peaked anywhere in 670-931 MB over fresh processes (a CI run failed at 931; thirty-eighth session); with the
    threshold fixed the peak is what is in use, 580.5-581.6 MB over six runs. The estimate bounds what is in use (1.57x
    it here), not the allocator's fragmentation on top of it, which once took a process 2 % past it."""
    proc = subprocess.run([sys.executable, "-c", _PEAK_PROBE, case.to_json()], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    peak = int(proc.stdout.split()[-1])
    need = memory_need(case)
    judge_side = need.inputs + need.reference + FIXED
    assert peak <= judge_side <= 3 * peak, (peak, judge_side)


# the judge's peak RSS for one case (argv[1]) beyond what the process held before it, printed in bytes
_PEAK_PROBE = """
import ctypes, sys
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.judge.expectation import op_expectations
from moe_lora_harness.harness.build.expert_runner import expert_expectations
case = Case.from_json(sys.argv[1])
judge = op_expectations if case.level == "op" else expert_expectations
if case.level == "op" and case.dtype == "float32":      # the runner's: with the twin's truth and emulation
    from moe_lora_harness.backends.eager import BACKEND
    from moe_lora_harness.harness.execution.runner import expectations
    judge = lambda c, _: expectations(BACKEND, c, "cpu")  # noqa: E731
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
judge(case.replace(T=1), "one_shot")            # imports and first-call allocations are not the case's
ctypes.CDLL("libc.so.6").malloc_trim(0)         # freed heap back to the system: RSS is what is in use
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                                # the peak (VmHWM) starts again from the current RSS
base = status("VmRSS:")
judge(case, "one_shot")
print(status("VmHWM:") - base)
"""


def test_a_case_too_large_for_the_budget_is_refused_not_run():
    layer, tokens = layer_from_config(TINY, "tiny"), (1, 4096 + 17)
    feats = [f for f in FEATURES if f.name == "experts: silu"]
    every = plan_model(layer, _eager(), "cpu", feats, tokens=tokens, budget=2**40)
    need = {c: memory_need(c).total for _, _, _, c in every.runs}
    budget = max(n for c, n in need.items() if c.T == 1)
    assert all(n > budget for c, n in need.items() if c.T > 1)
    plan = plan_model(layer, _eager(), "cpu", feats, tokens=tokens, budget=budget)   # T=1 fits, T=4113 does not
    assert {c.T for _, _, _, c in plan.runs} == {1}
    refused = [o for _, o in plan.prejudged]
    assert {o.case.T for o in refused} == {4113} and all(o.status == "not-runnable" for o in refused)
    # the inputs' copies: the judge's, the backend's, its snapshot and (a call within GUARD_MAX_BYTES) its guarded one
    assert all("needs" in o.reason and "GiB" in o.reason and f"{INPUT_COPIES + 1} x" in o.reason for o in refused)
    nothing = plan_model(layer, _eager(), "cpu", feats, tokens=tokens, budget=1)
    assert not nothing.runs and len(nothing.prejudged) == len(every.runs)


# ---------------------------------------------------------------- end to end

def _cli(*args, cwd):
    import moe_lora_harness
    parent = os.path.dirname(os.path.dirname(os.path.abspath(moe_lora_harness.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([parent, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return subprocess.run([sys.executable, "-m", "moe_lora_harness", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)


@pytest.mark.slow     # the CLI over a whole model plan; the gate: the plan, the estimate and the memory rules above
def test_check_model_config_end_to_end(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = _cli("check", "--model-config", "config.json", "--only", "eager", "--device", "cpu", "--tokens", "1,17",
               "--json", "m.json", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "experts: silu " in out.stdout and "pass" in out.stdout
    assert f"experts: gelu{NOT_APPLICABLE}" in out.stdout and "not applicable at" in out.stdout
    report = json.loads((tmp_path / "m.json").read_text())
    meta = report["meta"]["model"]
    assert meta["tokens"] == [1, 17] and meta["layer"].startswith("H=32 I=16 E=8 top_k=2 silu")
    assert report["matrix"]["eager"]["experts: silu"]["counts"]["pass"] == 4
    # the same run judges: a planted bug at this layer's shape fails it
    bad = _cli("check", "--model-config", ".", "--backend", "moe_lora_harness.harness.selftest.mutants:MUTANTS",
               "--only", "mutant-ignores-routed-weight", "--feature", "w2: mul_routed_weight", "--device", "cpu",
               "--tokens", "5", cwd=tmp_path)
    assert bad.returncode == 1 and "FAIL" in bad.stdout, bad.stdout[-3000:] + bad.stderr[-3000:]
