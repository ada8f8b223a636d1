"""Read a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) into one ExpertAdapter per
MoE layer: every layout PEFT 0.21 and 0.22 write or load for MoE experts, the module scalings as PEFT computes them.

Layouts (docs/adapters.md): LoRA on the fused 3-D expert parameters (`target_parameters`: gate_up_proj or
Nemotron-H's up_proj, and down_proj; nested wrappers, so the saved keys name the nesting depth, never the
parameter), and legacy per-expert modules (gate_proj/up_proj/down_proj, w1/w3/w2), which PEFT converts on load
into the fused form with gate_up rank 2r. Factors come back unscaled; `scaling` / `down_scaling` carry PEFT's.
"""
from __future__ import annotations

import json
import math
import pathlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from moe_lora_harness.reference.adapters import ExpertAdapter

__all__ = ["AdapterFileError", "READINGS", "FactorKey", "adapter_layers", "factor_keys", "other_keys", "read_adapter",
           "read_adapter_layers", "read_folder"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."

# the fused 3-D expert parameters, in the order every supported family registers them (the nesting follows it)
W13_PARAM = {True: "gate_up_proj", False: "up_proj"}      # gated -> name; non-gated (Nemotron-H): up_proj
W2_PARAM = "down_proj"
# legacy per-expert module names (transformers 4.x) -> the role PEFT's conversion gives them
LEGACY_ROLES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
# what PEFT 0.21 (and 0.22) refuses for a parameter wrapper (ParamWrapper.__init__), refused here too
_UNSUPPORTED = (("use_dora", True), ("lora_bias", True), ("fan_in_fan_out", True))

_FUSED_KEY = re.compile(r"^(?P<module>.*\.experts)(?P<nest>(?:\.base_layer)*)\.lora_(?P<ab>[AB])\.weight$")
_LEGACY_KEY = re.compile(r"^(?P<module>.*\.experts)\.(?P<e>\d+)\.(?P<name>[A-Za-z0-9_]+)\.lora_(?P<ab>[AB])\.weight$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class AdapterFileError(ValueError):
    """A file this reader cannot read as an MoE LoRA adapter: names the file or tensor key, its shape and what
    was expected (and, where the shape fits one, the known wrong layout it matches)."""


# ----------------------------------------------------------------------------- readings of a factor's data


@dataclass(frozen=True)
class FactorKey:
    """What one saved factor tensor is: its key, the parameter it adapts, A or B, and the sizes of its layout."""

    key: str
    param: str          # gate_up_proj / up_proj / down_proj
    ab: str             # "A" or "B"
    r: int
    E: int
    n_in: int
    n_out: int
    gated_w13: bool     # the B of a gated gate_up_proj (rows gate and up)
    interleaved: bool   # ... whose rows interleave gate and up (GPT-OSS)

    @property
    def peft_shape(self) -> tuple[int, int]:
        return (self.r * self.E, self.n_in) if self.ab == "A" else (self.n_out, self.r * self.E)


@dataclass(frozen=True)
class Reading:
    """One way of laying out a factor in the file: `canon` maps data written so to PEFT's layout."""

    name: str
    describes: str
    applies: object     # FactorKey -> bool
    canon: object       # (Tensor, FactorKey) -> Tensor of FactorKey.peft_shape


def _halves_to_pairs(t: Tensor) -> Tensor:
    """Rows [g0..g(I-1); u0..u(I-1)] -> [g0, u0, g1, u1, ...]."""
    n = t.shape[0] // 2
    out = torch.empty_like(t)
    out[0::2], out[1::2] = t[:n], t[n:]
    return out


def _pairs_to_halves(t: Tensor) -> Tensor:
    """Rows [g0, u0, g1, u1, ...] -> [g...; u...]."""
    return torch.cat([t[0::2], t[1::2]])


def _swap_gate_up(t: Tensor, f: FactorKey) -> Tensor:
    if f.interleaved:
        out = torch.empty_like(t)
        out[0::2], out[1::2] = t[1::2], t[0::2]
        return out
    n = t.shape[0] // 2
    return torch.cat([t[n:], t[:n]])


READINGS: dict[str, Reading] = {r.name: r for r in (
    Reading("peft", "PEFT's layout: A (r*E, in) expert-major rows, B (out, r*E) rank-major columns",
            lambda f: True, lambda t, f: t),
    Reading("b-expert-major", "B written as (out, E, r) (expert-major columns, the reading of vLLM #31534) "
            "instead of PEFT's (out, r, E)",
            lambda f: f.ab == "B" and f.r > 1 and f.E > 1,
            lambda t, f: t.reshape(f.n_out, f.E, f.r).permute(0, 2, 1).reshape(f.n_out, f.r * f.E)),
    Reading("a-rank-major", "A written as (r, E, in) (rank-major rows) instead of PEFT's (E, r, in)",
            lambda f: f.ab == "A" and f.r > 1 and f.E > 1,
            lambda t, f: t.reshape(f.r, f.E, f.n_in).permute(1, 0, 2).reshape(f.r * f.E, f.n_in)),
    Reading("a-transposed", "A written transposed, (in, r*E)",
            lambda f: f.ab == "A" and f.r * f.E == f.n_in, lambda t, f: t.T.contiguous()),
    Reading("b-transposed", "B written transposed, (r*E, out)",
            lambda f: f.ab == "B" and f.r * f.E == f.n_out, lambda t, f: t.T.contiguous()),
    Reading("gate-up-swapped", "gate_up B with the gate and up rows swapped",
            lambda f: f.gated_w13, _swap_gate_up),
    Reading("deinterleaved", "gate_up B rows in halves [gate; up], though the model interleaves them (GPT-OSS)",
            lambda f: f.gated_w13 and f.interleaved, lambda t, f: _halves_to_pairs(t)),
    Reading("interleaved", "gate_up B rows interleaved (gate at even, up at odd), though the model has halves",
            lambda f: f.gated_w13 and not f.interleaved, lambda t, f: _pairs_to_halves(t)),
)}


def _shape_hint(t: Tensor, f: FactorKey) -> str:
    """The known layout a wrongly shaped factor's shape fits, as a phrase ('' when none does)."""
    s, r, E, o, i = tuple(t.shape), f.r, f.E, f.n_out, f.n_in
    hints = {"B": {(o, E, r): "B written as (out, E, r), expert-major (vLLM #31534's reading)",
                   (o, r, E): "B not flattened: (out, r, E)", (E, o, r): "B per expert, (E, out, r)",
                   (r * E, o): "B transposed"},
             "A": {(i, r * E): "A transposed", (E, r, i): "A not flattened: (E, r, in)",
                   (r, E, i): "A written rank-major (r, E, in)"}}[f.ab]
    if s in hints:
        return hints[s]
    if len(s) == 2 and f.ab == "A" and s[1] == i and s[0] % E == 0:
        return f"A of rank {s[0] // E}, not the configured {r} (r / rank_pattern)"
    if len(s) == 2 and f.ab == "B" and s[0] == o and s[1] % E == 0:
        return f"B of rank {s[1] // E}, not the configured {r} (r / rank_pattern)"
    return ""


def _check_factor(t: Tensor, f: FactorKey) -> None:
    if tuple(t.shape) != f.peft_shape:
        hint = _shape_hint(t, f)
        raise AdapterFileError(
            f"tensor {f.key!r} (lora_{f.ab} of {f.param}) has shape {tuple(t.shape)}; expected {f.peft_shape} "
            f"(PEFT's layout for E={f.E}, r={f.r}, in={f.n_in}, out={f.n_out})"
            + (f"; the shape matches {hint}" if hint else ""))


# ----------------------------------------------------------------------------- the folder


@dataclass
class AdapterFolder:
    """An adapter folder's config and tensors (float, on the CPU), as saved."""

    path: pathlib.Path
    config: dict
    tensors: dict


def read_folder(path) -> AdapterFolder:
    """adapter_config.json and adapter_model.safetensors of `path` (read with safetensors; no hub access)."""
    folder = pathlib.Path(path)
    cfg_path, w_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not folder.is_dir():
        raise AdapterFileError(f"adapter {str(folder)!r} is not a folder (expected one holding {CONFIG_FILE} and "
                               f"{WEIGHTS_FILE})")
    for p in (cfg_path, w_path):
        if not p.is_file():
            extra = " (only the safetensors format is read; re-save with safe_serialization=True)" \
                if p is w_path and (folder / "adapter_model.bin").is_file() else ""
            raise AdapterFileError(f"adapter folder {str(folder)!r} has no {p.name}{extra}")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise AdapterFileError(f"{str(cfg_path)!r}: not valid JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise AdapterFileError(f"{str(cfg_path)!r}: key 'peft_type' must be 'LORA'; got "
                               f"{config.get('peft_type') if isinstance(config, dict) else type(config).__name__!r}")
    for k, bad in _UNSUPPORTED:
        if config.get(k) == bad:
            raise AdapterFileError(f"{str(cfg_path)!r}: {k}={bad!r} is not supported on MoE expert parameters "
                                   "(PEFT refuses it there too)")
    try:
        from safetensors import safe_open
    except ImportError:
        raise ImportError("reading adapter files needs safetensors: pip install 'moe-lora-harness[hf]'") from None
    try:
        with safe_open(str(w_path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors' own error types vary by version; the file is the finding
        raise AdapterFileError(f"{str(w_path)!r}: not a readable safetensors file ({type(e).__name__}: "
                               f"{str(e)[:200]}); truncated, or not fully downloaded?") from None
    return AdapterFolder(folder, config, tensors)


def _strip(key: str) -> str:
    return key[len(PREFIX):] if key.startswith(PREFIX) else key


def _layer_of(module: str) -> int:
    m = _LAYER.search(module + ".")
    return int(m.group(1)) if m else 0


def _expert_keys(folder: AdapterFolder) -> tuple[dict, dict]:
    """({layer: {(module, depth, ab): key}}, {layer: {(module, name, e, ab): key}}): the fused and the per-expert
    LoRA factors of `experts` modules (LoRA on other modules, e.g. attention, is not the experts' and is left)."""
    fused, legacy = {}, {}
    for key in folder.tensors:
        k = _strip(key)
        m = _FUSED_KEY.match(k)
        if m:
            depth = m.group("nest").count(".base_layer")
            fused.setdefault(_layer_of(m.group("module")), {})[(m.group("module"), depth, m.group("ab"))] = key
            continue
        m = _LEGACY_KEY.match(k)
        if m:
            if m.group("name") not in LEGACY_ROLES:
                raise AdapterFileError(f"tensor {key!r}: per-expert module {m.group('name')!r} is none of "
                                       f"{', '.join(LEGACY_ROLES)}")
            legacy.setdefault(_layer_of(m.group("module")), {})[
                (m.group("module"), m.group("name"), int(m.group("e")), m.group("ab"))] = key
    return fused, legacy


def other_keys(folder: AdapterFolder) -> list[str]:
    """The saved tensors that are not LoRA factors of a routed `experts` module (attention, a shared expert ...)."""
    return sorted(k for k in folder.tensors if not (_FUSED_KEY.match(_strip(k)) or _LEGACY_KEY.match(_strip(k))))


def adapter_layers(path) -> list[int]:
    """The decoder layers whose experts the adapter at `path` adapts, in order."""
    fused, legacy = _expert_keys(read_folder(path))
    return sorted(set(fused) | set(legacy))


def _pattern_value(patterns: Mapping, key: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first pattern P (in the file's order) with key matching
    `(.*\\.)?(P)$`, else `default`."""
    for p, v in (patterns or {}).items():
        if re.match(rf"(.*\.)?({p})$", key):
            return v
    return default


def _scaling(alpha: float, r: int, rslora: bool) -> float:
    return float(alpha) / (math.sqrt(r) if rslora else r)


# ----------------------------------------------------------------------------- fused (target_parameters) files


def _targeted(module: str, names: tuple, target_parameters) -> list[str]:
    """The parameters of `names` (in registration order) that target_parameters names on `module`."""
    mod = _strip(module)
    return [n for n in names if any(f"{mod}.{n}" == t or f"{mod}.{n}".endswith("." + t)
                                    for t in (target_parameters or ()))]


def _fused_plan(folder: AdapterFolder, keys: dict, gated: bool) -> tuple[str, list]:
    """(the experts module, [(parameter, nesting depth)]) of one layer's fused factors: the targeted parameters in
    registration order, the first the innermost wrapper (depth = how many `.base_layer` its keys carry)."""
    cfg = folder.config
    modules = sorted({m for m, _, _ in keys})
    if len(modules) != 1:
        raise AdapterFileError(f"adapter {str(folder.path)!r}: one layer holds several experts modules: {modules}")
    module = modules[0]
    order = (W13_PARAM[gated], W2_PARAM)
    targeted = _targeted(module, order, cfg.get("target_parameters"))
    others = [t for t in (cfg.get("target_parameters") or ()) if t.rpartition(".")[2] not in order]
    if others:
        raise AdapterFileError(f"adapter {str(folder.path)!r}: target_parameters {others} are not the "
                               f"{'gated' if gated else 'non-gated'} experts' {' / '.join(order)}")
    depths = sorted({d for _, d, _ in keys})
    if depths != list(range(len(targeted))):
        raise AdapterFileError(
            f"adapter {str(folder.path)!r}: {module} has LoRA factors at nesting depths {depths} "
            f"({', '.join(sorted(keys.values()))}) but target_parameters names {targeted or 'none'} of "
            f"{list(order)} there (expected depths {list(range(len(targeted)))})")
    return module, [(p, len(targeted) - 1 - k) for k, p in enumerate(targeted)]


def factor_keys(folder: AdapterFolder, layer: int, gated: bool) -> dict:
    """{parameter: {"A": key, "B": key}} of a fused file's factors in decoder layer `layer` ({} for none)."""
    fused, _ = _expert_keys(folder)
    keys = fused.get(layer)
    if not keys:
        return {}
    module, plan = _fused_plan(folder, keys, gated)
    return {p: {ab: keys[(module, d, ab)] for ab in "AB" if (module, d, ab) in keys} for p, d in plan}


def _read_fused(folder: AdapterFolder, keys: dict, *, E, H, I, gated, interleaved, dtype, readings) -> ExpertAdapter:
    cfg = folder.config
    module, plan = _fused_plan(folder, keys, gated)
    rslora = bool(cfg.get("use_rslora", False))
    factors, scalings = {}, {}
    for param, depth in plan:
        pkey = f"{_strip(module)}.{param}"
        r = int(_pattern_value(cfg.get("rank_pattern"), pkey, cfg.get("r", 8)))
        alpha = _pattern_value(cfg.get("alpha_pattern"), pkey, cfg.get("lora_alpha", 8))
        n_in, n_out = (H, (2 * I if gated else I)) if param != W2_PARAM else (I, H)
        per = {}
        for ab in ("A", "B"):
            key = keys.get((module, depth, ab))
            if key is None:
                raise AdapterFileError(f"adapter {str(folder.path)!r}: no lora_{ab} for {param} (expected key "
                                       f"{PREFIX}{module}{'.base_layer' * depth}.lora_{ab}.weight)")
            f = FactorKey(key, param, ab, r, E, n_in, n_out, gated and param != W2_PARAM, interleaved)
            t = folder.tensors[key]
            _check_factor(t, f)
            reading = READINGS[(readings or {}).get(key, "peft")]
            if not reading.applies(f):
                raise ValueError(f"reading {reading.name!r} does not apply to tensor {key!r}")
            per[ab] = reading.canon(t.to(dtype), f)
        a = per["A"].reshape(E, r, n_in)                               # row e*r + j: expert-major
        b = per["B"].reshape(n_out, r, E).permute(2, 0, 1)             # column j*E + e: rank-major
        factors[param], scalings[param] = (a.contiguous(), b.contiguous()), _scaling(alpha, r, rslora)
    return _assemble(factors, scalings, E=E, H=H, I=I, gated=gated, interleaved=interleaved, dtype=dtype)


def _assemble(factors: dict, scalings: dict, *, E, H, I, gated, interleaved, dtype) -> ExpertAdapter:
    """ExpertAdapter from per-parameter (A (E, r, in), B (E, out, r)); an untargeted module reads as zero factors
    of rank 1 (it adds exactly 0)."""
    w13 = W13_PARAM[gated]
    if w13 in factors:
        a, b = factors[w13]
        if gated:
            gate_b, up_b = (b[:, 0::2], b[:, 1::2]) if interleaved else (b[:, :I], b[:, I:])
            gate_a, up_a, gate_b, up_b = a, a.clone(), gate_b.contiguous(), up_b.contiguous()  # one shared A
        else:
            gate_a, gate_b, up_a, up_b = a, b, None, None
        scaling = scalings[w13]
    else:
        z_a, z_b = torch.zeros(E, 1, H, dtype=dtype), torch.zeros(E, I, 1, dtype=dtype)
        gate_a, gate_b = z_a, z_b
        up_a, up_b = (z_a.clone(), z_b.clone()) if gated else (None, None)
        scaling = 1.0
    if W2_PARAM in factors:
        down_a, down_b = factors[W2_PARAM]
        down_scaling = scalings[W2_PARAM]
    else:
        down_a, down_b, down_scaling = torch.zeros(E, 1, I, dtype=dtype), torch.zeros(E, H, 1, dtype=dtype), 1.0
    return ExpertAdapter(gate_a, gate_b, up_a, up_b, down_a, down_b, scaling, down_scaling)


# ----------------------------------------------------------------------------- legacy per-expert files


def _read_legacy(folder: AdapterFolder, keys: dict, *, E, H, I, gated, interleaved, dtype) -> ExpertAdapter:
    """PEFT 0.21's (and 0.22's) conversion on load (transformers 5.x): per-expert gate/up A stacked into one A of
    rank 2r, B block-diagonal [[B_gate, 0], [0, B_up]], alpha doubled; down stacked at rank r."""
    cfg = folder.config
    where = f"adapter {str(folder.path)!r}"
    if not gated or interleaved:
        raise AdapterFileError(f"{where}: per-expert LoRA keys ({next(iter(keys.values()))!r}) on a "
                               f"{'non-gated' if not gated else 'GPT-OSS-style interleaved'} model: PEFT 0.21 "
                               "converts per-expert adapters only for Mixtral- and Qwen2-MoE-style gated experts")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise AdapterFileError(f"{where}: a per-expert adapter with rank_pattern/alpha_pattern is not covered (PEFT "
                               "0.21's conversion overwrites the gate_up entry)")
    names = sorted({n for _, n, _, _ in keys})
    roles = {}
    for n in names:
        roles.setdefault(LEGACY_ROLES[n], []).append(n)
    if any(len(v) > 1 for v in roles.values()):
        raise AdapterFileError(f"{where}: per-expert modules {names} name one role twice ({roles})")
    if ("gate" in roles) != ("up" in roles):
        have, miss = ("gate", "up") if "gate" in roles else ("up", "gate")
        raise AdapterFileError(f"{where}: per-expert {roles[have][0]} is adapted without the {miss} projection; "
                               "PEFT cannot convert one half of the fused gate_up_proj")
    module = sorted({m for m, _, _, _ in keys})[0]
    r, alpha, rslora = int(cfg.get("r", 8)), cfg.get("lora_alpha", 8), bool(cfg.get("use_rslora", False))

    def stack(role: str, ab: str, shape: tuple) -> Tensor:
        name = roles[role][0]
        out = []
        for e in range(E):
            key = next((k for (m, n, x, a), k in keys.items() if (n, x, a) == (name, e, ab)), None)
            if key is None:
                raise AdapterFileError(f"{where}: no tensor for expert {e} of {name} (expected key "
                                       f"{PREFIX}{module}.{e}.{name}.lora_{ab}.weight)")
            t = folder.tensors[key]
            if tuple(t.shape) != shape:
                raise AdapterFileError(f"tensor {key!r} has shape {tuple(t.shape)}; expected {shape} (per-expert "
                                       f"lora_{ab} of {name}, r={r})")
            out.append(t.to(dtype))
        extra = sorted(k for (m, n, x, a), k in keys.items() if n == name and a == ab and x >= E)
        if extra:
            raise AdapterFileError(f"{where}: {extra[0]!r} is for expert >= E={E}")
        return torch.stack(out)

    factors, scalings = {}, {}
    if "gate" in roles:
        a = torch.cat([stack("gate", "A", (r, H)), stack("up", "A", (r, H))], dim=1)      # (E, 2r, H)
        b = torch.zeros(E, 2 * I, 2 * r, dtype=dtype)
        b[:, :I, :r], b[:, I:, r:] = stack("gate", "B", (I, r)), stack("up", "B", (I, r))
        factors["gate_up_proj"], scalings["gate_up_proj"] = (a, b), _scaling(2 * alpha, 2 * r, rslora)
    if "down" in roles:
        factors[W2_PARAM] = (stack("down", "A", (r, I)), stack("down", "B", (H, r)))
        scalings[W2_PARAM] = _scaling(alpha, r, rslora)
    return _assemble(factors, scalings, E=E, H=H, I=I, gated=True, interleaved=False, dtype=dtype)


# ----------------------------------------------------------------------------- public entry points


def _check_sizes(**sizes) -> None:
    for name, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


def read_adapter_layers(path, *, num_experts: int, hidden_size: int, intermediate_size: int, gated: bool,
                        interleaved: bool = False, dtype: torch.dtype = torch.float32,
                        readings: Mapping[str, str] | None = None, folder: AdapterFolder | None = None) -> dict:
    """{decoder layer: ExpertAdapter} of the adapter folder `path` for experts E x (H, I) (`gated`: gate_up_proj;
    else up_proj; `interleaved`: GPT-OSS's gate/up rows). Factors unscaled in `dtype`; `readings` maps a tensor key
    to a READINGS name (how its data is laid out; default 'peft'), for the diagnosis of a mis-laid-out file."""
    _check_sizes(num_experts=num_experts, hidden_size=hidden_size, intermediate_size=intermediate_size)
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype!r}")
    for k, v in (readings or {}).items():
        if v not in READINGS:
            raise ValueError(f"readings[{k!r}] = {v!r} is not one of {', '.join(READINGS)}")
    folder = folder if folder is not None else read_folder(path)
    fused, legacy = _expert_keys(folder)
    if not fused and not legacy:
        raise AdapterFileError(f"adapter {str(folder.path)!r} holds no LoRA factors of an `experts` module (keys: "
                               f"{', '.join(sorted(folder.tensors)[:4])}{' ...' if len(folder.tensors) > 4 else ''})")
    sizes = dict(E=num_experts, H=hidden_size, I=intermediate_size, gated=gated, interleaved=interleaved, dtype=dtype)
    out = {}
    for layer in sorted(set(fused) | set(legacy)):
        if layer in fused and layer in legacy:
            raise AdapterFileError(f"adapter {str(folder.path)!r}: layer {layer} has both fused and per-expert keys")
        out[layer] = (_read_fused(folder, fused[layer], readings=readings, **sizes) if layer in fused
                      else _read_legacy(folder, legacy[layer], **sizes))
    return out


def read_adapter(path, *, num_experts: int, hidden_size: int, intermediate_size: int, gated: bool,
                 layer: int = 0, interleaved: bool = False, dtype: torch.dtype = torch.float32) -> ExpertAdapter:
    """The ExpertAdapter of decoder layer `layer` of the PEFT adapter folder `path` (see read_adapter_layers)."""
    layers = read_adapter_layers(path, num_experts=num_experts, hidden_size=hidden_size,
                                 intermediate_size=intermediate_size, gated=gated, interleaved=interleaved, dtype=dtype)
    if layer not in layers:
        raise AdapterFileError(f"adapter {str(path)!r} adapts the experts of layers {sorted(layers)}, "
                               f"not layer {layer}")
    return layers[layer]
