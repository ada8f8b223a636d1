"""harness.served.peft_adapters against the PEFT model that saved the file: per-expert factors (as delta weights), ranks
and scalings (rank_pattern, alpha_pattern, rsLoRA, per-expert files converted as PEFT loads them), and the errors a
wrong file gets (key, shape, the shapes expected, the layout the shape matches)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from moe_lora_harness.harness.served.peft_adapters import AdapterFileError, adapter_layers, read_adapter, read_adapter_layers

from . import tiny_models as tm

FAM = "qwen3_moe"
H, I, E = tm.H, tm.I, tm.E


def _peft_delta(pm, layer: int, param: str) -> torch.Tensor:
    """PEFT's own delta weight (scaling included) of `param` in `layer`, from the model in memory."""
    mod = pm.get_submodule(f"base_model.model.model.layers.{layer}.mlp.experts")
    while mod.parameter_name != param:
        mod = mod.base_layer
    with torch.no_grad():
        return mod.get_delta_weight("default").detach()


def _ours(ad, param: str) -> torch.Tensor:
    """Our adapter's delta weight of `param`, (E, out, in), gate rows then up rows (split families)."""
    if param == "down_proj":
        return ad.w2_scaling * torch.bmm(ad.down_b, ad.down_a)
    return ad.scaling * torch.cat([torch.bmm(ad.gate_b, ad.gate_a), torch.bmm(ad.up_b, ad.up_a)], dim=1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A two-layer Qwen3-MoE adapter with per-module ranks and alphas (rank_pattern, alpha_pattern) and rsLoRA."""
    folder, pm = tm.peft_adapter(FAM, tmp_path_factory.mktemp("a") / "ad", ("gate_up_proj", "down_proj"), r=4,
                                 lora_alpha=8, use_rslora=True, rank_pattern={"down_proj": 2},
                                 alpha_pattern={"gate_up_proj": 3})
    return folder, pm


def test_factors_ranks_and_scalings_are_peft_s(saved):
    folder, pm = saved
    assert adapter_layers(folder) == [0, 1]
    layers = read_adapter_layers(folder, dtype=torch.float64, **tm.sizes(FAM))
    for n, ad in layers.items():
        assert (ad.w13_rank, ad.w2_rank, ad.rank) == (4, 2, 4)
        # rsLoRA: alpha / sqrt(r), each module with its own alpha and rank; not alpha / r
        assert ad.scaling == 3 / math.sqrt(4) and ad.w2_scaling == 8 / math.sqrt(2)
        assert ad.w2_scaling != 8 / 2
        for param in ("gate_up_proj", "down_proj"):
            truth = _peft_delta(pm, n, param)
            assert torch.allclose(_ours(ad, param), truth, rtol=0, atol=1e-14 * float(truth.abs().max()))
        # one A shared by gate and up: the two slices differ only in B
        assert torch.equal(ad.gate_a, ad.up_a) and not torch.equal(ad.gate_b, ad.up_b)
    # float32 factors: the saved values (float64 here, the model's dtype) rounded once
    f32 = read_adapter(folder, layer=1, **tm.sizes(FAM))
    assert f32.gate_a.dtype == torch.float32 and torch.equal(f32.down_b, layers[1].down_b.float())


def test_the_nesting_not_the_key_names_tells_the_parameter(tmp_path):
    """With gate_up_proj alone, `experts.lora_A` is gate_up_proj's (no base_layer); with down_proj alone, down's."""
    for targets, param in ((("gate_up_proj",), "gate_up_proj"), (("down_proj",), "down_proj")):
        folder, pm = tm.peft_adapter(FAM, tmp_path / param, targets, r=3, lora_alpha=6)
        ad = read_adapter(folder, dtype=torch.float64, **tm.sizes(FAM))
        assert torch.allclose(_ours(ad, param), _peft_delta(pm, 0, param), rtol=1e-13, atol=0)
        other = "down_proj" if param == "gate_up_proj" else "gate_up_proj"
        assert bool((_ours(ad, other) == 0).all())      # the untargeted module adds exactly 0


def test_per_expert_files_convert_as_peft_loads_them(tmp_path):
    """gate/up: one A of rank 2r ([A_gate; A_up]), B block-diagonal, alpha 2x (so rsLoRA scales by 2a/sqrt(2r));
    down: rank r. Measured against PeftModel.from_pretrained in test_verify; here the arithmetic."""
    folder, sd = tm.legacy_adapter("mixtral", tmp_path / "leg", 0, r=2, lora_alpha=3, use_rslora=True)
    ad = read_adapter(folder, dtype=torch.float64, **tm.sizes("mixtral"))
    assert (ad.w13_rank, ad.w2_rank) == (4, 2)
    assert ad.scaling == 6 / math.sqrt(4) and ad.w2_scaling == 3 / math.sqrt(2)
    key = "base_model.model.model.layers.0.block_sparse_moe.experts.5.{}.lora_{}.weight"
    assert torch.equal(ad.gate_a[5], torch.cat([sd[key.format("w1", "A")], sd[key.format("w3", "A")]]).double())
    assert torch.equal(ad.gate_b[5, :, :2], sd[key.format("w1", "B")].double())
    assert bool((ad.gate_b[5, :, 2:] == 0).all())
    assert torch.equal(ad.up_b[5, :, 2:], sd[key.format("w3", "B")].double()) and bool((ad.up_b[5, :, :2] == 0).all())
    assert torch.equal(ad.down_b[5], sd[key.format("w2", "B")].double())


def test_wrong_files_get_errors_naming_key_shape_and_layout(saved, tmp_path):
    folder, _ = saved
    key_b = "base_model.model.model.layers.0.mlp.experts.lora_B.weight"         # down_proj's B (H, r*E)
    key_a = "base_model.model.model.layers.0.mlp.experts.lora_A.weight"         # down_proj's A (r*E, I)

    def check(change, *needles):
        bad = tm.rewrite(folder, tmp_path / str(len(list(tmp_path.iterdir()))), change)
        with pytest.raises(AdapterFileError) as e:
            read_adapter_layers(bad, **tm.sizes(FAM))
        for n in needles:
            assert n in str(e.value), str(e.value)

    r = 2
    check(lambda t: {**t, key_b: t[key_b].reshape(H, r, E).permute(0, 2, 1)},      # B written (out, E, r), 3-D
          key_b, "(32, 8, 2)", "expected (32, 16)", "B written as (out, E, r)")
    check(lambda t: {**t, key_a: t[key_a].T}, key_a, "(24, 16)", "expected (16, 24)", "A transposed")
    check(lambda t: {**t, key_a: t[key_a][:8]}, "A of rank 1, not the configured 2")
    check(lambda t: {k: v for k, v in t.items() if k != key_b}, "no lora_B for down_proj", key_b)
    # the nesting disagrees with target_parameters: a down-only config over a both-modules file
    bad = tm.rewrite(folder, tmp_path / "cfg", lambda t: t)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "target_parameters": ["mlp.experts.down_proj"]}))
    with pytest.raises(AdapterFileError, match=r"nesting depths \[0, 1\].*expected depths \[0\]"):
        read_adapter_layers(bad, **tm.sizes(FAM))


def test_bad_folders_and_arguments(saved, tmp_path):
    folder, _ = saved
    with pytest.raises(AdapterFileError, match="has no adapter_model.safetensors"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
        read_adapter(tmp_path / "empty", **tm.sizes(FAM))
    with pytest.raises(AdapterFileError, match="is not a folder"):
        read_adapter(tmp_path / "nowhere", **tm.sizes(FAM))
    with pytest.raises(AdapterFileError, match=r"adapts the experts of layers \[0, 1\], not layer 5"):
        read_adapter(folder, layer=5, **tm.sizes(FAM))
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        read_adapter(folder, **{**tm.sizes(FAM), "num_experts": 0})
    with pytest.raises(ValueError, match="dtype must be torch.float32 or torch.float64"):
        read_adapter(folder, dtype=torch.float16, **tm.sizes(FAM))
    with pytest.raises(ValueError, match="is not one of peft"):
        read_adapter_layers(folder, readings={"k": "sideways"}, **tm.sizes(FAM))


def test_per_expert_file_errors(tmp_path):
    folder, sd = tm.legacy_adapter("qwen3_moe", tmp_path / "leg", 0, r=2, lora_alpha=2)
    half = tm.rewrite(folder, tmp_path / "half", lambda t: {k: v for k, v in t.items() if ".up_proj." not in k})
    with pytest.raises(AdapterFileError, match="gate_proj is adapted without the up projection"):
        read_adapter(half, **tm.sizes("qwen3_moe"))
    key = "base_model.model.model.layers.0.mlp.experts.3.down_proj.lora_A.weight"
    short = tm.rewrite(folder, tmp_path / "short", lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(AdapterFileError, match=r"no tensor for expert 3 of down_proj"):
        read_adapter(short, **tm.sizes("qwen3_moe"))
    with pytest.raises(AdapterFileError, match="only for Mixtral- and Qwen2-MoE-style gated experts"):
        read_adapter(folder, **{**tm.sizes("qwen3_moe"), "gated": False})
