"""A catalogue of served MoE layers, as their public config.json gives them, and the parser of such a file.

Each catalogue entry is the excerpt of a public config.json that was read (the keys the parser needs, with
their values), where a copy of it was read, and the Hugging Face repository it belongs to; the record is
that excerpt parsed by `layer_from_config`, so every number carries the key it came from (`MoELayer.sources`).
What a config.json does not say (a family's routing rule, GPT-OSS's alpha) is named as the family's modeling
code's constant. Sources and the table: docs/models.md.
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

from moe_lora_harness.reference.activations import (
    ACTIVATIONS,
    OAI_LIMIT,
    SUPPORTED_ACTIVATIONS,
    lookup_activation,
)

# the degrees `moe-lora-harness models` lists for tensor and expert parallelism: every degree 1..16 / 1..64 that
# divides the layer (as `--tp 3` runs where I % 3 == 0), not only the powers of two
TP_DEGREES = tuple(range(1, 17))
EP_DEGREES = tuple(range(1, 65))


@dataclass(frozen=True)
class MoELayer:
    """One served model's MoE layer: shapes, activation, biases, router, shared experts, checkpoint format.

    `sources` maps each field to where its value came from ("config.json key 'x'", or the family's rule that
    no key states); `unsourced` names the fields no source was found for (empty for every catalogue entry)."""

    name: str
    model_type: str
    H: int                        # hidden size
    I: int                        # routed expert's intermediate size (moe_intermediate_size)
    E: int                        # routed experts
    top_k: int
    activation: str               # in reference.activations' vocabulary
    bias: bool                    # expert biases (w13 and w2)
    scoring: str                  # router scores: softmax or sigmoid
    renormalize: bool             # top-k weights renormalized to sum 1 (norm_topk_prob)
    correction_bias: bool         # a per-expert score correction bias picks the experts (DeepSeek's noaux_tc)
    n_group: int                  # grouped top-k: expert groups, and how many of them a token may use
    topk_group: int
    routed_scaling_factor: float
    shared_experts: int           # always-on shared experts, and their (total) intermediate size
    shared_I: int
    quant: str                    # the public checkpoint's expert weight format
    activation_limit: float | None = None   # swiglu clamp limit (GPT-OSS's swiglu_limit)
    hf_repo: str = ""             # e.g. "Qwen/Qwen3-30B-A3B"; the config.json of `config_url`
    read_in: str = ""             # where the copy of that config.json that was read lives
    note: str = ""
    sources: tuple = ()           # ((field, source), ...)
    unsourced: tuple = ()

    @property
    def config_url(self) -> str:
        return f"https://huggingface.co/{self.hf_repo}/blob/main/config.json" if self.hf_repo else ""

    @property
    def gated(self) -> bool:
        return ACTIVATIONS[self.activation].gated

    @property
    def interleaved(self) -> bool:
        """Gate and up interleaved in w13 (GPT-OSS), not split in halves."""
        return ACTIVATIONS[self.activation].interleaved

    def source(self, field: str) -> str:
        return dict(self.sources).get(field, "")

    def routing_text(self) -> str:
        """One phrase: e.g. 'sigmoid+bias, groups 8/4, renorm, x2.5'."""
        parts = [self.scoring + ("+bias" if self.correction_bias else "")]
        if self.n_group > 1:
            parts.append(f"groups {self.n_group}/{self.topk_group}")
        parts.append("renorm" if self.renormalize else "no renorm")
        if self.routed_scaling_factor != 1.0:
            parts.append(f"x{self.routed_scaling_factor:g}")
        return ", ".join(parts)

    def tp_degrees(self) -> tuple:
        """The TP degrees (of TP_DEGREES) whose per-rank slice I / tp is whole."""
        return tuple(tp for tp in TP_DEGREES if self.I % tp == 0)

    def ep_degrees(self) -> tuple:
        """The EP degrees (of EP_DEGREES) that give every rank E / ep local experts."""
        return tuple(ep for ep in EP_DEGREES if ep <= self.E and self.E % ep == 0)


class ConfigError(ValueError):
    """A config.json this parser cannot read: names the file, the key and what was expected."""


# ---------------------------------------------------------------- the parser

def _load(path_or_dict) -> tuple[dict, str]:
    if isinstance(path_or_dict, dict):
        return path_or_dict, "the config"
    path = pathlib.Path(path_or_dict)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"config: {str(path)!r} is neither a config.json file nor a folder holding one")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"config {str(path)!r}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"config {str(path)!r}: expected a JSON object, got {type(d).__name__}")
    return d, repr(str(path))


class _Reader:
    """Reads keys of one config, remembering which key gave which field."""

    def __init__(self, d: dict, where: str, family: str):
        self.d, self.where, self.family = d, where, family
        self.sources: dict = {}

    def key(self, field: str, *keys, kind=int):
        """The value of the first of `keys` present (of the expected type), else a ConfigError naming them."""
        for k in keys:
            if k in self.d:
                v = self.d[k]
                ok = (isinstance(v, bool) if kind is bool
                      else isinstance(v, (int, float)) and not isinstance(v, bool) if kind is float
                      else isinstance(v, kind) and not isinstance(v, bool))
                if not ok or (kind is int and v < 1):
                    want = {int: "an integer >= 1", float: "a number", bool: "true or false", str: "a string"}[kind]
                    raise ConfigError(f"{self.where}: key {k!r} must be {want} for {self.family}; got {v!r}")
                self.sources[field] = f"config.json key {k!r}"
                return float(v) if kind is float else v
        raise ConfigError(f"{self.where}: missing key {' or '.join(repr(k) for k in keys)} ({field}) for model_type "
                          f"{self.d.get('model_type')!r}")

    def rule(self, field: str, value, why: str):
        """A value no config key states: the family's rule, with why."""
        self.sources[field] = f"not a config key: {why}"
        return value


def _activation(r: _Reader, keys: tuple, gated: bool) -> str:
    """The config's activation name in the reference's vocabulary (non-gated: the `_no_mul` member)."""
    act = r.key("activation", *keys, kind=str)
    name = {"gelu_pytorch_tanh": "gelu_tanh"}.get(act, act)
    name = name if gated else f"{name}_no_mul"
    if name not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(f"{r.where}: key {keys[0]!r} = {act!r} ({'gated' if gated else 'non-gated'} in "
                          f"{r.family}) has no supported reference activation; supported: "
                          f"{', '.join(SUPPORTED_ACTIVATIONS)}")
    return name


_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}   # a torch_dtype -> the quant column


def _quant(r: _Reader) -> str:
    """The checkpoint's expert format: quantization_config (fp8 with its block, mxfp4, ...) or the dtype."""
    q = r.d.get("quantization_config")
    if isinstance(q, dict) and "quant_method" in q:
        method = str(q["quant_method"])
        if method == "fp8":
            fmt = q.get("fmt", "e4m3")
            block = q.get("weight_block_size")
            r.sources["quant"] = "config.json keys 'quantization_config.quant_method', '.fmt', '.weight_block_size'"
            return f"fp8_{fmt}" + (f" block {block[0]}x{block[1]}" if block else "")
        r.sources["quant"] = "config.json key 'quantization_config.quant_method'"
        return method
    for k in ("torch_dtype", "dtype"):
        if isinstance(r.d.get(k), str):
            r.sources["quant"] = f"config.json key {k!r} (no quantization_config)"
            return _DTYPE_NAMES.get(r.d[k], r.d[k])
    raise ConfigError(f"{r.where}: missing key 'quantization_config', 'dtype' or 'torch_dtype' (the weights' format)")


def _softmax_family(r: _Reader, *, experts_key: tuple, inter_key: str, renorm_key: str | None, renorm_rule: str = ""):
    """Fields of a softmax-routed family without shared experts (Qwen3-MoE, Mixtral, GPT-OSS)."""
    f = dict(H=r.key("H", "hidden_size"), I=r.key("I", inter_key), E=r.key("E", *experts_key),
             top_k=r.key("top_k", "num_experts_per_tok", "experts_per_token"),
             scoring=r.rule("scoring", "softmax", f"{r.family}'s router is a softmax (modeling code)"),
             correction_bias=r.rule("correction_bias", False, f"{r.family} has no score correction bias"),
             n_group=r.rule("n_group", 1, f"{r.family} has no grouped top-k"),
             topk_group=r.rule("topk_group", 1, f"{r.family} has no grouped top-k"),
             routed_scaling_factor=r.rule("routed_scaling_factor", 1.0, f"{r.family} does not scale routed outputs"),
             shared_experts=r.rule("shared_experts", 0, f"{r.family} has no shared expert"),
             shared_I=r.rule("shared_I", 0, f"{r.family} has no shared expert"))
    f["renormalize"] = (r.key("renormalize", renorm_key, kind=bool) if renorm_key
                        else r.rule("renormalize", True, renorm_rule))
    return f


def _qwen3_moe(r: _Reader) -> dict:
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts
    return dict(_softmax_family(r, experts_key=("num_experts", "num_local_experts"), inter_key="moe_intermediate_size",
                                renorm_key="norm_topk_prob"),
                activation=_activation(r, ("hidden_act",), gated=True),
                bias=r.rule("bias", False, "Qwen3-MoE experts have no biases (modeling code)"))


def _mixtral(r: _Reader) -> dict:
    return dict(_softmax_family(r, experts_key=("num_local_experts",), inter_key="intermediate_size", renorm_key=None,
                                renorm_rule="Mixtral divides the top-k softmax weights by their sum (modeling code)"),
                activation=_activation(r, ("hidden_act",), gated=True),
                bias=r.rule("bias", False, "Mixtral experts have no biases (modeling code)"))


def _gpt_oss(r: _Reader) -> dict:
    limit = r.key("activation_limit", "swiglu_limit", kind=float)
    if limit != OAI_LIMIT:
        raise ConfigError(f"{r.where}: key 'swiglu_limit' = {limit:g}; the reference's swigluoai clamps at "
                          f"{OAI_LIMIT:g} (reference.activations.OAI_LIMIT)")
    return dict(_softmax_family(r, experts_key=("num_local_experts",), inter_key="intermediate_size", renorm_key=None,
                                renorm_rule="GPT-OSS takes the top-k router logits, then a softmax over those k "
                                            "(modeling code): the top-k softmax weights renormalized"),
                activation=r.rule("activation", "swigluoai", "GPT-OSS's experts: interleaved gate/up, clamped "
                                  "at swiglu_limit, alpha 1.702 (modeling code), up + 1"),
                bias=r.rule("bias", True, "GPT-OSS experts have gate_up and down biases (modeling code)"),
                activation_limit=limit)


def _grouped_sigmoid(r: _Reader, *, scoring_default: str | None) -> dict:
    """The router fields of DeepSeek-V3-style routing (also Nemotron-H's MoE)."""
    if scoring_default is None:
        scoring = r.key("scoring", "scoring_func", kind=str)
    else:
        scoring = r.rule("scoring", scoring_default, f"{r.family}'s router is a sigmoid (modeling code)")
    if scoring not in ("softmax", "sigmoid"):
        raise ConfigError(f"{r.where}: key 'scoring_func' = {scoring!r}; expected 'softmax' or 'sigmoid'")
    if "topk_method" in r.d:
        method = r.key("correction_bias", "topk_method", kind=str)
        correction = method == "noaux_tc"
        r.sources["correction_bias"] = "config.json key 'topk_method' ('noaux_tc': e_score_correction_bias)"
    else:
        correction = r.rule("correction_bias", True, f"{r.family}'s router adds e_score_correction_bias to the "
                                                     f"scores to choose experts (modeling code)")
    return dict(scoring=scoring, correction_bias=correction,
                n_group=r.key("n_group", "n_group"), topk_group=r.key("topk_group", "topk_group"),
                routed_scaling_factor=r.key("routed_scaling_factor", "routed_scaling_factor", kind=float),
                renormalize=r.key("renormalize", "norm_topk_prob", kind=bool))


def _deepseek_v3(r: _Reader) -> dict:
    f = dict(H=r.key("H", "hidden_size"), I=r.key("I", "moe_intermediate_size"), E=r.key("E", "n_routed_experts"),
             top_k=r.key("top_k", "num_experts_per_tok"), activation=_activation(r, ("hidden_act",), gated=True),
             bias=r.rule("bias", False, "DeepSeek-V3 experts have no biases (modeling code)"),
             shared_experts=r.key("shared_experts", "n_shared_experts"),
             # transformers' DeepseekV3Config has no scoring_func (its router is a sigmoid); the hub's config names it
             **_grouped_sigmoid(r, scoring_default=None if "scoring_func" in r.d else "sigmoid"))
    f["shared_I"] = r.rule("shared_I", f["shared_experts"] * f["I"],
                           "n_shared_experts x moe_intermediate_size (DeepSeek's shared MLP, modeling code)")
    return f


def _nemotron_h(r: _Reader) -> dict:
    return dict(H=r.key("H", "hidden_size"), I=r.key("I", "moe_intermediate_size"), E=r.key("E", "n_routed_experts"),
                top_k=r.key("top_k", "num_experts_per_tok"),
                activation=_activation(r, ("mlp_hidden_act",), gated=False),
                bias=r.key("bias", "mlp_bias", kind=bool),
                shared_experts=r.key("shared_experts", "n_shared_experts"),
                shared_I=r.key("shared_I", "moe_shared_expert_intermediate_size"),
                **_grouped_sigmoid(r, scoring_default="sigmoid"))


# model_type -> (family name, field reader); Mixtral-style and DeepSeek-V3-style model types share readers
FAMILIES = {
    "qwen3_moe": ("Qwen3-MoE", _qwen3_moe),
    "mixtral": ("Mixtral", _mixtral),
    "gpt_oss": ("GPT-OSS", _gpt_oss),
    "deepseek_v3": ("DeepSeek-V3", _deepseek_v3),
    "nemotron_h": ("Nemotron-H", _nemotron_h),
}


def layer_from_config(path_or_dict, name: str = "", *, hf_repo: str = "", read_in: str = "",
                      note: str = "", where: str = "") -> MoELayer:
    """A config.json (a path, a folder holding one, or its dict) -> its MoE layer; a ConfigError names the file
    (`where`: the file a dict was read from), the missing or malformed key and what was expected."""
    d, read_from = _load(path_or_dict)
    where = where or read_from
    mt = d.get("model_type")
    if mt not in FAMILIES:
        raise ConfigError(f"{where}: key 'model_type' = {mt!r} is not a known MoE family; known: "
                          f"{', '.join(sorted(FAMILIES))}" if mt is not None else
                          f"{where}: missing key 'model_type' (one of {', '.join(sorted(FAMILIES))})")
    family, read = FAMILIES[mt]
    r = _Reader(d, where, family)
    fields = read(r)
    fields["quant"] = _quant(r)
    if fields["top_k"] > fields["E"]:
        raise ConfigError(f"{where}: top_k {fields['top_k']} exceeds the expert count {fields['E']}")
    if fields["n_group"] > 1 and (fields["E"] % fields["n_group"] or fields["topk_group"] > fields["n_group"]):
        raise ConfigError(f"{where}: n_group {fields['n_group']} must divide E={fields['E']} and be >= topk_group "
                          f"{fields['topk_group']}")
    lookup_activation(fields["activation"])
    return MoELayer(name=name or str(d.get("_name_or_path") or mt), model_type=mt, hf_repo=hf_repo, read_in=read_in,
                    note=note, sources=tuple(sorted(r.sources.items())),
                    unsourced=tuple(f for f in fields if f not in r.sources), **fields)


def to_config(layer: MoELayer) -> dict:
    """The layer written back as a minimal config.json of its family (layer_from_config reads it back)."""
    d = dict(model_type=layer.model_type, hidden_size=layer.H, num_experts_per_tok=layer.top_k)
    act = layer.activation.removesuffix("_no_mul")
    if layer.model_type == "qwen3_moe":
        d.update(moe_intermediate_size=layer.I, num_experts=layer.E, norm_topk_prob=layer.renormalize, hidden_act=act)
    elif layer.model_type == "mixtral":
        d.update(intermediate_size=layer.I, num_local_experts=layer.E, hidden_act=act)
    elif layer.model_type == "gpt_oss":
        d.update(intermediate_size=layer.I, num_local_experts=layer.E, swiglu_limit=layer.activation_limit)
    else:   # deepseek_v3, nemotron_h
        d.update(moe_intermediate_size=layer.I, n_routed_experts=layer.E, n_group=layer.n_group,
                 topk_group=layer.topk_group, routed_scaling_factor=layer.routed_scaling_factor,
                 norm_topk_prob=layer.renormalize, n_shared_experts=layer.shared_experts)
        if layer.model_type == "deepseek_v3":
            d.update(hidden_act=act, scoring_func=layer.scoring,
                     topk_method="noaux_tc" if layer.correction_bias else "greedy")
        else:
            d.update(mlp_hidden_act=act, mlp_bias=layer.bias, moe_shared_expert_intermediate_size=layer.shared_I)
    if layer.quant.startswith("fp8_"):
        fmt, _, block = layer.quant.removeprefix("fp8_").partition(" block ")
        q = dict(quant_method="fp8", fmt=fmt)
        if block:
            q["weight_block_size"] = [int(x) for x in block.split("x")]
        d["quantization_config"] = q
    elif layer.quant in _DTYPE_NAMES.values():
        d["torch_dtype"] = next(k for k, v in _DTYPE_NAMES.items() if v == layer.quant)
    else:
        d["quantization_config"] = dict(quant_method=layer.quant)
    return d


# ---------------------------------------------------------------- the catalogue

def _entry(name: str, hf_repo: str, read_in: str, excerpt: dict, note: str = "") -> MoELayer:
    return layer_from_config(excerpt, name, hf_repo=hf_repo, read_in=read_in, note=note)


_MAXTEXT = "github AI-Hypercomputer/maxtext src/MaxText/utils/ckpt_conversion/utils/hf_model_configs.py"

# Each excerpt holds the keys read from a copy of the repository's config.json (`read_in` says where).
MODELS = (
    _entry("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", f"{_MAXTEXT} (qwen3_30b_a3b_thinking_2507_config: the 2507 update, "
           "the same MoE keys as copies of Qwen3-30B-A3B's own config.json in the code index)",
           dict(model_type="qwen3_moe", hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                num_experts_per_tok=8, norm_topk_prob=True, hidden_act="silu", torch_dtype="bfloat16"),
           note="bf16; FP8 weights are published separately (Qwen/Qwen3-30B-A3B-FP8)"),
    _entry("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", f"{_MAXTEXT} (qwen3_235b_a22b_thinking_2507_config: the 2507 "
           "update, the same MoE keys as copies of Qwen3-235B-A22B's own config.json in the code index)",
           dict(model_type="qwen3_moe", hidden_size=4096, moe_intermediate_size=1536, num_experts=128,
                num_experts_per_tok=8, norm_topk_prob=True, hidden_act="silu", torch_dtype="bfloat16"),
           note="bf16; FP8 weights are published separately (Qwen/Qwen3-235B-A22B-FP8)"),
    _entry("mixtral-8x7b", "mistralai/Mixtral-8x7B-Instruct-v0.1", f"{_MAXTEXT} (mixtral_8x7b_dict)",
           dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                num_experts_per_tok=2, hidden_act="silu", torch_dtype="bfloat16")),
    _entry("mixtral-8x22b", "mistralai/Mixtral-8x22B-Instruct-v0.1", f"{_MAXTEXT} (mixtral_8x22b_dict)",
           dict(model_type="mixtral", hidden_size=6144, intermediate_size=16384, num_local_experts=8,
                num_experts_per_tok=2, hidden_act="silu", torch_dtype="bfloat16")),
    _entry("gpt-oss-20b", "openai/gpt-oss-20b", f"{_MAXTEXT} (gpt_oss_20b_dict, its mxfp4 quantization_config removed "
           "there, as its comment says)",
           dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                num_experts_per_tok=4, swiglu_limit=7.0, quantization_config=dict(quant_method="mxfp4"))),
    _entry("gpt-oss-120b", "openai/gpt-oss-120b", f"{_MAXTEXT} (gpt_oss_120b_dict, its mxfp4 quantization_config "
           "removed there, as its comment says)",
           dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_local_experts=128,
                num_experts_per_tok=4, swiglu_limit=7.0, quantization_config=dict(quant_method="mxfp4"))),
    _entry("deepseek-v3", "deepseek-ai/DeepSeek-V3", f"{_MAXTEXT} (deepseek3_671b_dict, its fp8 quantization_config "
           "removed there); the quantization_config as deepseek-ai/DeepSeek-V3's README_WEIGHTS.md gives it",
           dict(model_type="deepseek_v3", hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=256,
                num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc", hidden_act="silu",
                quantization_config=dict(quant_method="fp8", fmt="e4m3", weight_block_size=[128, 128]))),
    _entry("nemotron-3-nano-30b-a3b", "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
           "github mehulbafnaa/jax-llm-examples nemotron3/tests/test_model.py (NEMOTRON3_30B_JSON, the whole file)",
           dict(model_type="nemotron_h", hidden_size=2688, moe_intermediate_size=1856, n_routed_experts=128,
                num_experts_per_tok=6, mlp_hidden_act="relu2", mlp_bias=False, n_shared_experts=1,
                moe_shared_expert_intermediate_size=3712, n_group=1, topk_group=1, routed_scaling_factor=2.5,
                norm_topk_prob=True, torch_dtype="bfloat16")),
)


def model_named(name: str) -> MoELayer:
    """The catalogue's layer called `name` (case-insensitive); a ValueError lists the names."""
    for m in MODELS:
        if m.name == str(name).lower():
            return m
    raise ValueError(f"--model {name!r}: no such model in the catalogue; models: {', '.join(m.name for m in MODELS)}")


def case_fields(model: MoELayer, tp: int = 1, ep: int = 1) -> dict:
    """The Case fields of one rank's slice of `model`'s layer: H, I / tp (TP shards the intermediate size), E with
    ep_size / ep_rank (the last rank: its expert_map is offset furthest), top_k, activation, biases. A degree the
    layer does not divide by is a ValueError naming it."""
    for label, v in (("tp", tp), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"--{label} must be an integer >= 1; got {v!r}")
    if model.I % tp:
        raise ValueError(f"--tp {tp}: {model.name}'s intermediate size I={model.I} does not divide into {tp} equal "
                         f"slices; TP degrees that do: {', '.join(map(str, model.tp_degrees()))}")
    if model.E % ep or ep > model.E:
        raise ValueError(f"--ep {ep}: {model.name}'s {model.E} experts do not split evenly over {ep} ranks; EP "
                         f"degrees that do: {', '.join(map(str, model.ep_degrees()))}")
    return dict(H=model.H, I=model.I // tp, E=model.E, top_k=model.top_k, activation=model.activation,
                bias=model.bias, tp_size=1, ep_size=ep, ep_rank=ep - 1)
