"""`fuzz --model` (harness.search.model_fuzz): the search at a served layer's shape. Every drawn case carries the fields the
layer fixes and a token count of the list, the rest drawn; a planted bug is found there, its minimal case at that
shape and replayable alone."""
from __future__ import annotations

import json

import pytest

from hypothesis import given, settings

from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.served.models import layer_from_config
from moe_lora_harness.harness.spec.registry import available_backends, select
from moe_lora_harness.harness.draw.strategies import claimed_cases
from moe_lora_harness.harness.draw.profiles import draw_sizes
from moe_lora_harness.harness.search.model_fuzz import served_cases

TINY = {"model_type": "qwen3_moe", "hidden_size": 32, "moe_intermediate_size": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "hidden_act": "silu", "torch_dtype": "bfloat16"}
LAYER = layer_from_config(TINY, "tiny")
EAGER = select(available_backends(), ["eager"])["eager"]


def _served(level: str):
    return served_cases(claimed_cases(EAGER, "cpu", level, **draw_sizes("cpu", level)), LAYER, EAGER, "cpu",
                        tokens=(1, 17, 300))


@settings(max_examples=40, deadline=None)
@given(_served("expert"))
def test_expert_draws_take_the_layers_shape(case: Case):
    assert (case.H, case.I, case.E, case.top_k, case.activation) == (32, 16, 8, 2, "silu")
    assert case.T in (1, 17, 300) and not case.problems()


@settings(max_examples=40, deadline=None)
@given(_served("op"))
def test_op_draws_take_the_layers_shape_and_its_slice_count(case: Case):
    assert (case.H, case.I, case.E, case.top_k) == (32, 16, 8, 2) and case.T in (1, 17, 300)
    assert case.which == "w2" or case.num_slices == 2          # a gated layer's w13 has gate and up


def test_fuzz_model_finds_a_planted_bug_at_the_layers_shape(tmp_path):
    """A mutant that ignores the routing weights (the w2 pass's mul_routed_weight), searched at the tiny layer's
    shape: found, its minimal case at that shape with a token count of the list."""
    from moe_lora_harness.harness.front.cli import main
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "out"
    rc = main(["fuzz", "--model-config", str(tmp_path), "--backend", "moe_lora_harness.harness.selftest.mutants:MUTANTS",
               "--only", "mutant-ignores-routed-weight", "--device", "cpu", "--max-examples", "80", "--tokens", "1,17",
               "--no-db", "--out", str(out), "-q", "--seed", "1"])
    assert rc == 1
    found = json.loads((out / "failure-01.json").read_text())
    case = Case.from_json(json.dumps(found["case"]))
    assert (case.H, case.I, case.E, case.top_k) == (32, 16, 8, 2) and case.T in (1, 17), case
    assert "replay" in found["repro"] and '"H":32' in found["repro"]


def test_jobs_that_fit_runs_as_many_campaigns_as_the_device_holds_at_the_layer(monkeypatch):
    """--jobs N splits the device's free memory N ways and each job draws only what its share holds: at a layer whose
    cases exceed a share, N jobs would test nothing (the served fuzz of DeepSeek-V3 with --jobs 8 on the H200 said
    "NOTHING TESTED ... claimed by its declarations"). Fewer jobs, said why; none fitting at all is an error."""
    from moe_lora_harness.harness.search import model_fuzz
    from moe_lora_harness.harness.build.case_memory import memory_need
    from moe_lora_harness.harness.draw.strategies import examples
    strategy = claimed_cases(EAGER, "cpu", "expert", **draw_sizes("cpu", "expert"))
    needs = sorted(memory_need(c, "cpu").total for c in examples(
        model_fuzz._claimed_at_layer(strategy, LAYER, EAGER, "cpu", 1, 1, (1, 17, 300)), model_fuzz.FIT_SAMPLE))
    median = needs[len(needs) // 2]

    def fit(free: int, jobs: int):
        monkeypatch.setattr(model_fuzz, "free_bytes", lambda device: (free, "test memory"))
        return model_fuzz.jobs_that_fit(strategy, LAYER, EAGER, "cpu", jobs, tokens=(1, 17, 300))

    assert fit(100 * median, 8) == (8, "")
    jobs, why = fit(3 * median, 8)
    assert jobs == 3 and "3 job(s) instead of 8" in why and "tiny" in why and "test memory" in why
    assert fit(median, 4)[0] == 1
    with pytest.raises(ValueError, match="smallest drawn case needs"):
        fit(needs[0] - 1, 2)
