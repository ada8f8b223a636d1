"""`check --model-config ... --adapter DIR`: PEFT files in the slots of every expert-level case, at their own ranks
and scalings, judged against the reference; a backend that drops an adapter fails; bad options are usage errors."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moe_lora_harness.backends.eager import BACKEND as EAGER
from moe_lora_harness.backends.eager import run_experts
from moe_lora_harness.harness.build.builders import build_expert_inputs
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.front.cli import main
from moe_lora_harness.harness.execution.execute import InProcess
from moe_lora_harness.harness.check.model_plan import adapter_fields
from moe_lora_harness.harness.served.models import layer_from_config
from moe_lora_harness.harness.served.peft_adapters import read_adapter
from moe_lora_harness.harness.execution.runner import run_case

from . import tiny_models as tm


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("check_adapter")
    a = tm.peft_adapter("qwen3_moe", d / "a", ("gate_up_proj", "down_proj"), r=4, lora_alpha=8)[0]
    b = tm.peft_adapter("qwen3_moe", d / "b", ("gate_up_proj", "down_proj"), seed=3, r=2, lora_alpha=3,
                        use_rslora=True)[0]
    other = tm.peft_adapter("nemotron_h", d / "other", ("up_proj", "down_proj"), r=4, lora_alpha=8)[0]
    return a, b, other, tm.write_config("qwen3_moe", d / "model")


def _case(files):
    a, b, _, config = files
    layer = layer_from_config(str(config))
    fields = adapter_fields(layer, [str(a), str(b)])
    return Case(level="expert", T=9, H=tm.H, I=tm.I, E=tm.E, top_k=2, dtype="float32", mapping="mixed", seed=3,
                **fields)


def test_the_files_fill_the_slots_at_their_ranks_and_scalings(files):
    a, b, _, _ = files
    case = _case(files)
    assert case.ranks[:2] == (4, 2) and case.max_rank == 4 and not case.problems()
    inp = build_expert_inputs(case)
    for slot, path in enumerate((a, b)):
        ad = read_adapter(path, **tm.sizes("qwen3_moe"))
        r = ad.w2_rank
        assert torch.equal(inp.stacked.w2_a[0][slot, :, :r], ad.down_a)
        assert torch.equal(inp.stacked.w2_b[0][slot, :, :, :r], ad.down_b * ad.w2_scaling)
    assert inp.stacked.adapter_enabled.tolist() == [1, 1, 0, 0]


def test_check_with_adapter_files_passes_and_a_dropped_adapter_fails(files, tmp_path):
    a, b, _, config = files
    out = tmp_path / "m.json"
    rc = main(["check", "--model-config", str(config), "--adapter", str(a), "--adapter", str(b), "--only", "eager",
               "--tokens", "5", "--feature", "experts: fp32", "--feature", "experts: tokens without adapter",
               "--in-process", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["matrix"]
    assert rows and all("pass" in json.dumps(cells) for cells in rows.values()), rows

    def drops_slot_1(call):   # reads slot 1's B as zeros (its inputs stay as they were)
        def zeroed(ts):
            ts = [t.clone() for t in ts]
            for t in ts:
                t[1] = 0
            return ts
        run_experts(dataclasses.replace(call, w13_lora_b=zeroed(call.w13_lora_b), w2_lora_b=zeroed(call.w2_lora_b)))
    spec = dataclasses.replace(EAGER, name="drops-slot-1", experts=drops_slot_1, op=None)
    case = _case(files)
    assert (build_expert_inputs(case).token_lora_mapping == 1).any(), "the case must map a token to slot 1"
    o = run_case(spec, case, "cpu", executor=InProcess(), reruns=0)
    assert o.status == "fail" and o.kind in ("element", "aggregate"), o.detail
    assert str(a) in o.detail   # the REPRO names the files


def test_bad_adapter_options_are_usage_errors(files, capsys):
    a, _, other, config = files
    assert main(["check", "--adapter", str(a), "--only", "eager"]) == 2
    assert "--adapter needs --model" in capsys.readouterr().err
    assert main(["check", "--model-config", str(config), "--tp", "2", "--adapter", str(a), "--only", "eager"]) == 2
    assert "TP slice" in capsys.readouterr().err
    assert main(["check", "--model-config", str(config), "--adapter", str(other), "--only", "eager"]) == 2
    err = capsys.readouterr().err
    assert "--adapter" in err and "other" in err
