"""Tiny configs of each MoE family the adapter suites cover (H, I, E of a few tens), and the adapter files made
from them with PEFT's own save_pretrained, B made non-zero, so that every layout PEFT writes is checked."""
from __future__ import annotations

import json
import pathlib

import torch

from moe_lora_harness.harness.served.hf_moe_block import hf_session   # transformers first imported with the checkout's
                                                              # root off sys.path (its kernels/ folder shadows a hub
                                                              # package transformers probes for)

H, I, E = 32, 24, 8

# family -> (model_type, config keys); every MoE family's experts are E x (H, I); DeepSeek-V3's layer 0 is dense
TINY = {
    "qwen3_moe": ("qwen3_moe", dict(hidden_size=H, moe_intermediate_size=I, intermediate_size=48, num_experts=E,
                                    num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2)),
    "qwen3_moe_no_norm": ("qwen3_moe", dict(hidden_size=H, moe_intermediate_size=I, intermediate_size=48,
                                            num_experts=E, num_experts_per_tok=3, norm_topk_prob=False,
                                            num_hidden_layers=1)),
    "mixtral": ("mixtral", dict(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2,
                                num_hidden_layers=1)),
    "gpt_oss": ("gpt_oss", dict(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2,
                                num_hidden_layers=1, layer_types=["full_attention"], sliding_window=8,
                                swiglu_limit=7.0)),   # as the hub's config (a transformers may not write it)
    "deepseek_v3": ("deepseek_v3", dict(hidden_size=H, moe_intermediate_size=I // 2, intermediate_size=48,
                                        n_routed_experts=E, num_experts_per_tok=2, n_group=4, topk_group=2,
                                        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                                        norm_topk_prob=True, num_hidden_layers=2, q_lora_rank=None,
                                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                        scoring_func="sigmoid", topk_method="noaux_tc")),   # as the hub's config
    "nemotron_h": ("nemotron_h", dict(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E,
                                      num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                                      moe_shared_expert_intermediate_size=16, mlp_hidden_act="relu2",
                                      layers_block_type=["moe"], routed_scaling_factor=1.0)),
}
COMMON = dict(vocab_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16, torch_dtype="float32")


def config(family: str):
    """The transformers config of a tiny model of `family`."""
    with hf_session():
        from transformers import AutoConfig
    model_type, keys = TINY[family]
    return AutoConfig.for_model(model_type, **COMMON, **keys)


def write_config(family: str, folder: pathlib.Path) -> pathlib.Path:
    """config.json of the tiny model in `folder` (as a checkpoint ships it); its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(config(family).to_json_string())
    return path


def model(family: str, seed: int = 0):
    """The tiny model itself, float64, with random weights (what PEFT attaches to before saving)."""
    with hf_session():
        from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(config(family)).to(torch.float64)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) / max(1, p.shape[-1]) ** 0.5)
    return m


def peft_adapter(family: str, folder: pathlib.Path, targets: tuple, *, seed: int = 1, zero_b: bool = False,
                 **lora):
    """A PEFT adapter of the tiny `family` model on the experts' fused parameters `targets` (e.g. ('gate_up_proj',
    'down_proj')), saved by PEFT's save_pretrained with every B drawn non-zero (PEFT initializes B to 0; `zero_b`
    keeps that). (folder, the PeftModel in memory)."""
    with hf_session():
        from peft import LoraConfig, get_peft_model
    config = LoraConfig(target_modules=[], target_parameters=[f"experts.{t}" for t in targets], **lora)
    pm = get_peft_model(model(family), config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name and not zero_b:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / p.shape[1] ** 0.5)
    pm.save_pretrained(folder)
    return folder, pm


def rewrite(src: pathlib.Path, dst: pathlib.Path, change) -> pathlib.Path:
    """A copy of adapter folder `src` in `dst` whose tensors are `change(dict of tensors)` (a mis-laid-out file)."""
    from safetensors.torch import load_file, save_file
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    tensors = change(dict(load_file(str(src / "adapter_model.safetensors"))))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "adapter_model.safetensors"))
    return dst


def w13_name(family: str) -> str:
    """The experts' w13 parameter of `family` (Nemotron-H's experts are not gated: up_proj)."""
    return "up_proj" if TINY[family][0] == "nemotron_h" else "gate_up_proj"


def sizes(family: str) -> dict:
    """read_adapter's size keywords for the tiny `family` model."""
    keys = TINY[family][1]
    return dict(num_experts=E, hidden_size=keys["hidden_size"],
                intermediate_size=keys.get("moe_intermediate_size", keys.get("intermediate_size")),
                gated=TINY[family][0] != "nemotron_h")


# the per-expert module names of transformers 4.x, and the block they sat in
LEGACY_NAMES = {"mixtral": (("w1", "w3", "w2"), "block_sparse_moe"),
                "qwen3_moe": (("gate_proj", "up_proj", "down_proj"), "mlp"),
                "deepseek_v3": (("gate_proj", "up_proj", "down_proj"), "mlp")}


def legacy_adapter(family: str, folder: pathlib.Path, layer: int, *, r: int, lora_alpha: float, seed: int = 2,
                   use_rslora: bool = False, shared_expert: bool = False) -> tuple:
    """A per-expert adapter file as PEFT wrote it for transformers 4.x (one nn.Linear per expert and projection:
    A (r, in), B (out, r)); `shared_expert` adds DeepSeek's shared-expert factors. (folder, {key: tensor})."""
    from safetensors.torch import save_file
    (gate, up, down), block = LEGACY_NAMES[TINY[family][0]]
    keys = TINY[family][1]
    Hm, Im, Em = keys["hidden_size"], keys.get("moe_intermediate_size", keys.get("intermediate_size")), E
    g = torch.Generator().manual_seed(seed)
    sd = {}
    prefix = f"base_model.model.model.layers.{layer}.{block}"
    for e in range(Em):
        for name, n_in, n_out in ((gate, Hm, Im), (up, Hm, Im), (down, Im, Hm)):
            sd[f"{prefix}.experts.{e}.{name}.lora_A.weight"] = torch.randn(r, n_in, generator=g) / n_in ** 0.5
            sd[f"{prefix}.experts.{e}.{name}.lora_B.weight"] = torch.randn(n_out, r, generator=g) / r ** 0.5
    if shared_expert:
        for name, n_in, n_out in ((gate, Hm, Im), (up, Hm, Im), (down, Im, Hm)):
            sd[f"{prefix}.shared_experts.{name}.lora_A.weight"] = torch.randn(r, n_in, generator=g) / n_in ** 0.5
            sd[f"{prefix}.shared_experts.{name}.lora_B.weight"] = torch.randn(n_out, r, generator=g) / r ** 0.5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(dict(
        peft_type="LORA", r=r, lora_alpha=lora_alpha, use_rslora=use_rslora, lora_dropout=0.0, bias="none",
        target_modules=[gate, up, down], task_type="CAUSAL_LM")))
    return folder, sd
