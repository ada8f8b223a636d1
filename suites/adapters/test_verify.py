"""`adapter verify` (harness.served.adapter_verify) on PEFT's own files: every family x every layout passes, several
adapters of different ranks in several slots at once; mis-laid-out files and planted reader mistakes fail, the
line naming the tensor key and the layout its data matches; an adapter that changes nothing is not a pass."""
from __future__ import annotations

import importlib.metadata

import pytest
import torch

from moe_lora_harness.harness.served.adapter_verify import Line, verify

from . import tiny_models as tm


def _fails(report) -> list:
    return [x for x in report.lines if isinstance(x, Line) and not x.ok]


def _text(report) -> str:
    return report.text()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("adapters")


def _layouts(family: str, root):
    """Four adapters in four slots: both modules (alpha != r), w13 only with rsLoRA, down only, and both with
    per-module ranks and alphas (rank_pattern / alpha_pattern)."""
    w13 = tm.w13_name(family)
    d = root / family
    return [tm.peft_adapter(family, d / "both", (w13, "down_proj"), r=4, lora_alpha=8)[0],
            tm.peft_adapter(family, d / "w13", (w13,), r=3, lora_alpha=5, use_rslora=True, seed=2)[0],
            tm.peft_adapter(family, d / "down", ("down_proj",), r=2, lora_alpha=2, seed=3)[0],
            tm.peft_adapter(family, d / "pattern", (w13, "down_proj"), r=2, lora_alpha=4, seed=4,
                            rank_pattern={w13: 5}, alpha_pattern={"down_proj": 3})[0]]


@pytest.mark.parametrize("family", list(tm.TINY))
def test_every_layout_of_every_family_agrees_with_peft(family, root):
    dirs = _layouts(family, root)
    config = tm.write_config(family, root / family / "model")
    report = verify(dirs, config, layers=2)
    assert report.ok, _text(report)
    text = _text(report)
    w13 = tm.w13_name(family)
    # each adapted parameter of each adapter is a tensor line; each slot and the unadapted tokens a forward line
    assert text.count(f"{w13} delta weight") == 3 * len(report_layers(text)) and \
        text.count("down_proj delta weight") == 3 * len(report_layers(text))
    for i in range(4):
        assert f"[{i}] experts forward" in text
    assert "tokens without an adapter (-1)" in text and "PEFT adapter disabled" in text
    if family in ("deepseek_v3", "nemotron_h"):
        assert "shared expert: not adapted" in text and "bit-identical" in text
    assert ("layer 1" in text) == (family in ("qwen3_moe", "deepseek_v3"))


def report_layers(text: str) -> list:
    return [ln for ln in text.splitlines() if ln.startswith("layer ")]


# PEFT 0.22 matches a per-expert file's bare module names (gate_proj ...) on DeepSeek's shared expert too: it applies
# the shared-expert factors a file holds, and reports them missing from one that has none; 0.21 dropped them
PEFT_ADAPTS_SHARED_EXPERT = tuple(int(p) for p in importlib.metadata.version("peft").split(".")[:2]) >= (0, 22)


@pytest.mark.parametrize("family,layer", [("qwen3_moe", 0), ("mixtral", 0), ("deepseek_v3", 1)])
def test_per_expert_files_as_peft_converts_them(family, layer, root):
    """transformers 4.x per-expert adapters, loaded by PEFT onto the fused 5.x experts (gate_up rank 2r; rsLoRA's
    2a/sqrt(2r)): the routed experts agree with PEFT, layout, forward and all. DeepSeek's shared-expert factors in
    the file are outside them, said in a note; PEFT 0.21 drops them, and 0.22 applies them, which verify fails with
    its reason (the harness's LoRA is the routed experts'), as it fails the file without them that PEFT 0.22 finds
    keys missing from."""
    d = root / f"legacy-{family}"
    a, _ = tm.legacy_adapter(family, d / "plain", layer, r=2, lora_alpha=3)
    b, _ = tm.legacy_adapter(family, d / "rs", layer, r=3, lora_alpha=4, use_rslora=True,
                             shared_expert=family == "deepseek_v3")
    report = verify([a, b], tm.write_config(family, d / "model"))
    text = _text(report)
    failed = [ln.text() for ln in _fails(report)]
    routed = [ln for ln in report.lines if isinstance(ln, Line) and not ln.informative and "shared" not in ln.label
              and "PEFT load" not in ln.label]
    assert routed and all(ln.ok for ln in routed), text
    assert "gate_up_proj delta weight (per-expert keys, converted by PEFT)" in text
    if family != "deepseek_v3" or not PEFT_ADAPTS_SHARED_EXPERT:
        assert report.ok and not failed, text
    else:
        assert [f for f in failed if "shared expert: not adapted" in f] and [f for f in failed if "PEFT load" in f]
        assert "the file adapts the shared expert, which the harness's routed-expert LoRA does not cover" in text
        assert "Found missing adapter keys" in text and "shared_experts.gate_proj" in text and len(failed) == 2
    if family == "deepseek_v3":
        assert "6 tensor(s) outside the routed experts are not verified" in text and "shared_experts" in text


# ----------------------------------------------------------------------------- mis-laid-out files


def _b_expert_major(t: torch.Tensor, r: int) -> torch.Tensor:
    """B (out, r*E) with column j*E + e written as column e*r + j instead (the (out, E, r) layout), flattened."""
    out = t.shape[0]
    return t.reshape(out, r, tm.E).permute(0, 2, 1).reshape(out, r * tm.E)


@pytest.fixture(scope="module")
def qwen(root):
    d = root / "mislaid-qwen"
    folder = tm.peft_adapter("qwen3_moe", d / "good", ("gate_up_proj", "down_proj"), r=4, lora_alpha=8)[0]
    return folder, tm.write_config("qwen3_moe", d / "model"), d


@pytest.fixture(scope="module")
def gpt_oss(root):
    d = root / "mislaid-gpt-oss"
    folder = tm.peft_adapter("gpt_oss", d / "good", ("gate_up_proj", "down_proj"), r=4, lora_alpha=8)[0]
    return folder, tm.write_config("gpt_oss", d / "model"), d


PREFIX = "base_model.model.model.layers.0.mlp.experts"
GATE_UP_A, GATE_UP_B = f"{PREFIX}.base_layer.lora_A.weight", f"{PREFIX}.base_layer.lora_B.weight"
DOWN_A, DOWN_B = f"{PREFIX}.lora_A.weight", f"{PREFIX}.lora_B.weight"


def _flagged(report, key: str, reading: str) -> None:
    """The report fails, and the failing delta line names `key` and the reading its data matches."""
    assert not report.ok
    notes = [x.note for x in _fails(report) if "delta weight" in x.label]
    assert any(key in n and f"(reading {reading!r})" in n for n in notes), _text(report)


def test_b_written_expert_major_is_named(qwen):
    good, config, d = qwen
    bad = tm.rewrite(good, d / "b-expert-major", lambda t: {**t, DOWN_B: _b_expert_major(t[DOWN_B], 4)})
    report = verify([bad], config, against=[good])
    _flagged(report, DOWN_B, "b-expert-major")
    assert "B written as (out, E, r)" in _text(report)
    # the forward of that slot fails too; the gate_up factors, untouched, still agree
    assert any("experts forward" in x.label for x in _fails(report))
    assert not any("gate_up_proj delta" in x.label for x in _fails(report))
    # the same file against itself: PEFT reads it as the harness does (a file's layout is seen only against a truth)
    assert verify([bad], config).ok


def test_gate_up_halves_swapped_is_named(qwen):
    good, config, d = qwen
    bad = tm.rewrite(good, d / "swapped", lambda t: {**t, GATE_UP_B: torch.cat([t[GATE_UP_B][24:], t[GATE_UP_B][:24]])})
    _flagged(verify([bad], config, against=[good]), GATE_UP_B, "gate-up-swapped")


def test_square_a_transposed_is_named_and_other_shapes_are_read_errors(gpt_oss):
    """GPT-OSS's gate_up A is (r*E, H) = (32, 32): a transposed A loads and only the data tells; down's A
    (32, 24) transposed is caught by its shape."""
    good, config, d = gpt_oss
    bad = tm.rewrite(good, d / "a-t", lambda t: {**t, GATE_UP_A: t[GATE_UP_A].T})
    _flagged(verify([bad], config, against=[good]), GATE_UP_A, "a-transposed")
    bad = tm.rewrite(good, d / "a-t-down", lambda t: {**t, DOWN_A: t[DOWN_A].T})
    report = verify([bad], config, against=[good])
    assert not report.ok and len(_fails(report)) == 1
    note = _fails(report)[0].note
    assert DOWN_A in note and "(24, 32)" in note and "expected (32, 24)" in note and "A transposed" in note


def test_gpt_oss_written_in_halves_is_named(gpt_oss):
    good, config, d = gpt_oss
    bad = tm.rewrite(good, d / "halves",
                     lambda t: {**t, GATE_UP_B: torch.cat([t[GATE_UP_B][0::2], t[GATE_UP_B][1::2]])})
    _flagged(verify([bad], config, against=[good]), GATE_UP_B, "deinterleaved")


def test_planted_reader_mistakes_fail_and_name_peft_s_layout(gpt_oss, qwen):
    """The harness's own reading made wrong (vLLM #31534's B, a GPT-OSS file read in halves) fails against PEFT,
    and the fitting reading is PEFT's."""
    good, config, _ = qwen
    report = verify([good], config, readings={DOWN_B: "b-expert-major"})
    _flagged(report, DOWN_B, "peft")
    good, config, _ = gpt_oss
    report = verify([good], config, readings={GATE_UP_B: "deinterleaved"})
    _flagged(report, GATE_UP_B, "peft")


def test_an_adapter_that_changes_nothing_is_not_a_pass(qwen, root):
    _, config, d = qwen
    zero = tm.peft_adapter("qwen3_moe", d / "zero", ("gate_up_proj", "down_proj"), r=4, lora_alpha=8, zero_b=True)[0]
    report = verify([zero], config)
    assert not report.ok
    assert any("changes nothing" in x.note for x in _fails(report))
