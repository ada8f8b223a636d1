"""A model's MoE blocks built from its config.json by transformers itself, float64 with random weights, mounted in
a skeleton of the model (every other part left out) so that PEFT attaches an adapter file by its real keys.

transformers and peft are imported lazily (`hf()`); a missing one names the extra that installs it.
"""
from __future__ import annotations

import contextlib
import copy
import json
import pathlib
import sys
from dataclasses import dataclass

import torch

from moe_lora_harness.harness.served.models import ConfigError, MoELayer, layer_from_config
from moe_lora_harness.harness.served.peft_adapters import W2_PARAM, W13_PARAM

__all__ = ["MoEModel", "build_moe_model", "hf", "hf_session", "model_config"]

_ROOT = pathlib.Path(__file__).resolve().parents[2]     # the checkout's root (the package's folder installed)


@contextlib.contextmanager
def hf_session():
    """Run transformers/peft with the checkout's root off sys.path: from the repository root (`python -m`, `python
    -c`) its top-level `kernels/` folder shadows the hub package of that name that transformers probes for."""
    hidden = [(i, p) for i, p in enumerate(sys.path) if pathlib.Path(p or ".").resolve() == _ROOT]
    for _, p in hidden:
        sys.path.remove(p)
    try:
        yield
    finally:
        for i, p in hidden:         # back where they were
            sys.path.insert(i, p)


def hf():
    """(transformers, peft), or an ImportError that says how to install them."""
    try:
        with hf_session():
            import peft
            import transformers
    except ImportError as e:
        raise ImportError(f"adapter verification needs transformers and peft ({e}): "
                          "pip install 'moe-lora-harness[hf]'") from None
    return transformers, peft


@dataclass
class MoEModel:
    """The skeleton (a transformers model of the config's class, holding only the mounted MoE blocks), the layer
    description parsed by harness.served.models, and each mounted layer's block path (e.g. 'model.layers.1.mlp')."""

    skeleton: torch.nn.Module
    layer: MoELayer
    blocks: dict            # decoder layer -> block path
    config: object          # the transformers config

    def block(self, model: torch.nn.Module, layer: int) -> torch.nn.Module:
        """Layer `layer`'s block inside `model` (the skeleton, or a PeftModel wrapping a copy of it)."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return base.get_submodule(self.blocks[layer])


def read_config(path) -> dict:
    """config.json (a file, or a folder holding one) as a dict."""
    p = pathlib.Path(path)
    p = p / "config.json" if p.is_dir() else p
    if not p.is_file():
        raise ConfigError(f"model config {str(p)!r} is neither a config.json file nor a folder holding one")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"model config {str(p)!r}: not valid JSON ({e})") from None


def model_config(path) -> tuple[object, MoELayer]:
    """(the transformers config, the MoE layer harness.served.models reads) of config.json `path`. The dict read is given
    every alias the config class maps (transformers 5 saves Qwen3-MoE's `num_experts` as `num_local_experts`)."""
    transformers, _ = hf()
    d = read_config(path)
    if "model_type" not in d:
        raise ConfigError(f"model config {str(path)!r}: missing key 'model_type'")
    p = pathlib.Path(path)
    with hf_session():
        try:
            cls = transformers.CONFIG_MAPPING[d["model_type"]]
        except KeyError:
            raise ConfigError(f"model config {str(path)!r}: model_type {d['model_type']!r} is unknown to "
                              f"transformers {transformers.__version__}") from None
        cfg = cls.from_json_file(str(p / "config.json" if p.is_dir() else p))    # its own JSON (Infinity, ...)
    seen = dict(d)
    for alias, real in getattr(type(cfg), "attribute_map", {}).items():
        if alias not in seen and real in d:
            seen[alias] = d[real]
    if d.get("moe_latent_size"):
        raise ConfigError(f"model config {str(path)!r}: moe_latent_size={d['moe_latent_size']} (a latent "
                          "projection around the experts) is not covered")
    cfg._experts_implementation = "eager"
    return cfg, layer_from_config(seen, where=f"model config {str(path)!r}")


def _experts_path(model: torch.nn.Module, layer: int, gated: bool) -> str | None:
    """The path of decoder layer `layer`'s experts module (the owner of the fused 3-D expert parameters)."""
    want = {W13_PARAM[gated], W2_PARAM}
    for name, mod in model.named_modules():
        if f".layers.{layer}." not in f".{name}.":
            continue
        own = {n for n, p in mod.named_parameters(recurse=False) if p.dim() == 3}
        if want <= own:
            return name
    return None


def _randomize(block: torch.nn.Module, seed: int) -> None:
    """Every parameter ~ randn / sqrt(fan-in); float buffers (a score correction bias) ~ 0.1 randn."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / max(1, p.shape[-1]) ** 0.5)
        for _, b in block.named_buffers():
            if b.is_floating_point():
                b.copy_(0.1 * torch.randn(b.shape, generator=g, dtype=torch.float64))


def build_moe_model(config_path, layers, *, seed: int = 0) -> MoEModel:
    """The MoE blocks of decoder `layers` of the model of `config_path`, float64, random (seeded), in a skeleton of
    the model's class whose other parts are removed; experts run transformers' eager (per-expert loop) forward."""
    transformers, _ = hf()
    cfg, layer = model_config(config_path)
    with hf_session():
        with torch.device("meta"):
            try:
                model = transformers.AutoModelForCausalLM.from_config(cfg)
            except ValueError:
                model = transformers.AutoModel.from_config(cfg)
        blocks = {}
        for n in layers:
            path = _experts_path(model, n, layer.gated)
            if path is None:
                raise ConfigError(f"layer {n} of the {layer.model_type} model of {str(config_path)!r} has no MoE "
                                  f"experts ({W13_PARAM[layer.gated]} and {W2_PARAM})")
            blocks[n] = path.rpartition(".")[0]
        _strip_to(model, blocks.values())
        for n, path in blocks.items():
            parent, _, attr = path.rpartition(".")
            meta_block = model.get_submodule(path)
            try:
                block = type(meta_block)(cfg)
            except TypeError:
                block = type(meta_block)(cfg, layer_idx=n)
            block = block.to(torch.float64).eval()
            _randomize(block, seed * 1000 + n)
            setattr(model.get_submodule(parent), attr, block)
    return MoEModel(model.eval(), layer, blocks, cfg)


def _strip_to(model: torch.nn.Module, keep) -> None:
    """Replace every module not on the way to a path of `keep` by an empty Identity (drops the meta weights)."""
    keep = list(keep)

    def visit(mod: torch.nn.Module, prefix: str) -> None:
        for name, child in list(mod.named_children()):
            path = f"{prefix}{name}"
            if any(k == path for k in keep):
                continue
            if any(k.startswith(path + ".") for k in keep):
                visit(child, path + ".")
            elif isinstance(mod, torch.nn.ModuleList):
                mod[int(name)] = torch.nn.Identity()
            else:
                setattr(mod, name, torch.nn.Identity())

    visit(model, "")


def fresh_copy(m: MoEModel) -> torch.nn.Module:
    """A deep copy of the skeleton, for one adapter (PEFT wraps modules in place)."""
    return copy.deepcopy(m.skeleton)
