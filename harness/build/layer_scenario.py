"""A scenario: a layer configuration and the steps that drive it (load, unload, forward, capture, replay),
plain data that replays alone; and every tensor a step needs, made from its seed.

  {"config": {LayerConfig fields}, "seed": 0, "steps": [
     {"do": "load", "slot": 0, "rank": 4, "seed": 5},            # "zero_b": true for an adapter with B = 0
     {"do": "forward", "mapping": [0, -1, 1], "seed": 3},        # T = len(mapping)
     {"do": "capture", "size": 4},
     {"do": "replay", "size": 4, "mapping": [0, -1], "seed": 9},  # 2 tokens padded to the captured 4
     {"do": "unload", "slot": 0}]}
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import torch

from moe_lora_harness.harness.build.builders import ADAPTER_SCALING, build_device
from moe_lora_harness.harness.spec.layer_contract import LayerBatch, LayerConfig, LayerWeights
from moe_lora_harness.reference.activations import is_gated
from moe_lora_harness.reference.adapters import ExpertAdapter
from moe_lora_harness.reference.routing import fused_topk

STEP_KINDS = ("load", "unload", "forward", "capture", "replay")
RUNS = ("forward", "replay")   # the steps that produce an output to judge


def load_step(slot: int, rank: int, seed: int, **kw) -> dict:
    """A load step (kw: w2_rank, scaling, w2_scaling, zero_b)."""
    return {"do": "load", "slot": slot, "rank": rank, "seed": seed, **kw}


def forward_step(mapping, seed: int) -> dict:
    return {"do": "forward", "mapping": list(mapping), "seed": seed}


def replay_step(size: int, mapping, seed: int) -> dict:
    """A replay of `len(mapping)` tokens padded to the captured `size`."""
    return {"do": "replay", "size": size, "mapping": list(mapping), "seed": seed}


@dataclass(frozen=True)
class Scenario:
    """A layer configuration (its device is the run's) and the steps that drive it."""

    config: LayerConfig
    steps: tuple = ()
    seed: int = 0

    def with_steps(self, steps) -> "Scenario":
        return dataclasses.replace(self, steps=tuple(steps))

    def to_dict(self) -> dict:
        cfg = self.config.to_dict()
        cfg.pop("device")
        return {"config": cfg, "seed": self.seed, "steps": [dict(s) for s in self.steps]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | dict) -> "Scenario":
        d = json.loads(text) if isinstance(text, str) else dict(text)
        unknown = sorted(set(d) - {"config", "seed", "steps"})
        if unknown:
            raise ValueError(f"unknown scenario field(s) {unknown}; a scenario has config, seed, steps")
        steps = tuple(dict(s) for s in d.get("steps", ()))
        for i, s in enumerate(steps):
            if s.get("do") not in STEP_KINDS:
                raise ValueError(f"steps[{i}]: 'do' must be one of {STEP_KINDS}; got {s.get('do')!r}")
        return cls(LayerConfig.from_dict(d["config"]), steps, int(d.get("seed", 0)))

    def problems(self) -> list:
        """What makes the scenario impossible for any layer of its config (malformed, not a layer's fault)."""
        c, out, captured = self.config, [], set()
        for i, s in enumerate(self.steps):
            kind = s["do"]
            if kind in ("load", "unload") and not 0 <= s["slot"] < c.max_loras:
                out.append(f"steps[{i}]: slot {s['slot']} outside [0, max_loras={c.max_loras})")
            if kind == "load":
                out += [f"steps[{i}]: {k} {s.get(k)!r} outside [1, max_rank={c.max_rank}]" for k in ("rank", "w2_rank")
                        if (k == "rank" or k in s) and not (type(s.get(k)) is int and 1 <= s[k] <= c.max_rank)]
                out += [f"steps[{i}]: {k} {s[k]!r} is not a finite number" for k in ("scaling", "w2_scaling")
                        if k in s and not (type(s[k]) in (int, float) and math.isfinite(s[k]))]
            if kind in RUNS:
                T = len(s["mapping"])
                size = s.get("size", T)
                if not 0 <= T <= size <= c.max_tokens:
                    out.append(f"steps[{i}]: {T} tokens in a batch of {size}, max_tokens={c.max_tokens}")
                if any(not -1 <= m < c.max_loras for m in s["mapping"]):
                    out.append(f"steps[{i}]: mapping values must lie in [-1, {c.max_loras})")
            if kind == "capture":
                captured.add(s["size"])
                if s["size"] not in c.capture_sizes:
                    out.append(f"steps[{i}]: capture size {s['size']} not in capture_sizes {list(c.capture_sizes)}")
            if kind == "replay" and s["size"] not in captured:
                out.append(f"steps[{i}]: replay at size {s['size']} before any capture at that size")
        return out


def _gen(seed: int, salt: int, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + salt)


def base_weights(scenario: Scenario, device) -> LayerWeights:
    """The layer's base weights (randn / sqrt(fan-in), biases 0.5 randn), from the scenario's seed, drawn where a
    run on `device` draws (builders.build_device: its GPU, else the CPU; a GPU draws other values than the CPU,
    the same on every run there: at LARGE_LAYER the CPU's float64 draws were half of a GPU search's time)."""
    c = scenario.config
    at = build_device(device)
    dt, g = c.torch_dtype, _gen(scenario.seed, 1, at)
    n1 = 2 * c.I if is_gated(c.activation) else c.I
    w13 = (torch.randn(c.E, n1, c.H, generator=g, dtype=torch.float64, device=at) / math.sqrt(c.H)).to(dt)
    w2 = (torch.randn(c.E, c.H, c.I, generator=g, dtype=torch.float64, device=at) / math.sqrt(c.I)).to(dt)
    if c.quant != "none":   # snapped to the scheme's grid: a layer that quantizes what it is given loses nothing
        from moe_lora_harness.reference.quant import dequantize, quantize
        w13, w2 = (dequantize(*quantize(w, c.quant, dt), c.quant, dt) for w in (w13, w2))
    b13 = (0.5 * torch.randn(c.E, n1, generator=g, device=at)).to(dt) if c.bias else None
    b2 = (0.5 * torch.randn(c.E, c.H, generator=g, device=at)).to(dt) if c.bias else None
    mv = lambda t: None if t is None else t.to(device)  # noqa: E731
    return LayerWeights(mv(w13), mv(w2), mv(b13), mv(b2))


def adapter(config: LayerConfig, step: dict, device="cpu") -> ExpertAdapter:
    """The adapter a load step loads (float32 checkpoint factors): w13 rank `rank` and scaling `scaling` (default
    ADAPTER_SCALING), w2 its own `w2_rank` / `w2_scaling` when given (PEFT's gate_up 2r, down r); zero_b: B = 0.
    Drawn and left where a run on `device` draws (base_weights); a layer is handed it on the CPU (on_cpu)."""
    at = build_device(device)
    a = ExpertAdapter.random(config.E, config.H, config.I, step["rank"], is_gated(config.activation),
                             scaling=step.get("scaling", ADAPTER_SCALING), generator=_gen(step["seed"], 2, at),
                             down_rank=step.get("w2_rank"), down_scaling=step.get("w2_scaling"), device=at)
    if step.get("zero_b"):
        a = dataclasses.replace(a, gate_b=torch.zeros_like(a.gate_b), down_b=torch.zeros_like(a.down_b),
                                up_b=None if a.up_b is None else torch.zeros_like(a.up_b))
    return a


def on_cpu(record):
    """A dataclass record (an adapter, as a checkpoint is loaded and a layer's load_adapter is given it; an
    expectation) with its tensor fields on the CPU."""
    return dataclasses.replace(record, **{f.name: v.cpu() for f in dataclasses.fields(record)
                                          for v in [getattr(record, f.name)] if isinstance(v, torch.Tensor)})


def batch(config: LayerConfig, step: dict, device) -> LayerBatch:
    """The batch of a forward (T = len(mapping) tokens) or a replay (its captured size): random hidden
    states with a few -0.0, router logits, and the router's choice (softmax, top-k, renormalized)."""
    size = step.get("size", len(step["mapping"]))
    g = _gen(step["seed"], 3)
    x = torch.randn(size, config.H, generator=g).to(config.torch_dtype)
    x[::3, ::7] = -0.0            # a token's sign of zero must survive the layer's untouched paths
    logits = with_margin(torch.randn(size, config.E, generator=g, dtype=torch.float32), config.top_k)
    w, ids = fused_topk(logits, config.top_k, config.renormalize)
    return LayerBatch(x.to(device), logits.to(device), w.to(device), ids.to(device))


# the least gap between a token's k-th and (k+1)-th logit: a layer that routes itself from the logits (a real engine's
# fused top-k, its own softmax) chooses the same experts as the judge's router whatever its fp32 rounding (a near-tie
# chosen the other way would read as a wrong value); logits are N(0, 1), their fp32 rounding ~1e-7
ROUTING_MARGIN = 0.05


def with_margin(logits: torch.Tensor, k: int) -> torch.Tensor:
    """`logits` (S, E) with each row's top k raised so they lead the rest by at least ROUTING_MARGIN (the same
    choice, no near-tie at the boundary)."""
    if k >= logits.shape[-1] or logits.shape[0] == 0:
        return logits
    top, ids = logits.topk(k + 1, dim=-1)
    lift = (ROUTING_MARGIN - (top[:, k - 1] - top[:, k])).clamp_min(0)
    chosen = torch.zeros_like(logits).scatter_(1, ids[:, :k], 1.0)
    return logits + chosen * lift[:, None]


def mapping(step: dict, device) -> torch.Tensor:
    """The step's token -> slot mapping, (T,) int32."""
    return torch.tensor(list(step["mapping"]), dtype=torch.int32, device=device)


class LayerState:
    """What the layer should hold after each step: the adapter steps per slot (None: empty) and the sizes
    captured. The model the judge reads after every forward."""

    def __init__(self, config: LayerConfig):
        self.config = config
        self.slots: list = [None] * config.max_loras
        self.captured: set = set()
        self._drawn: dict = {}      # (slot, device) -> the slot's adapter, drawn once per load

    def apply(self, step: dict) -> None:
        kind = step["do"]
        if kind == "load":
            self.slots[step["slot"]] = dict(step)
        elif kind == "unload":
            self.slots[step["slot"]] = None
        elif kind == "capture":
            self.captured.add(step["size"])
        if kind in ("load", "unload"):
            self._drawn = {k: v for k, v in self._drawn.items() if k[0] != step["slot"]}

    def adapters(self, device="cpu") -> list:
        """ExpertAdapter per slot (None: empty), as the reference packs them, drawn where a run on `device` draws
        (each loaded adapter once: the judge reads them at every judged step)."""
        out = []
        for i, s in enumerate(self.slots):
            if s is not None and (i, str(device)) not in self._drawn:
                self._drawn[i, str(device)] = adapter(self.config, s, device)
            out.append(None if s is None else self._drawn[i, str(device)])
        return out

    def effective_mapping(self, step: dict) -> torch.Tensor:
        """The slot each row of the step's output is judged with: -1 where the token has no adapter (mapped
        to -1 or to an empty slot); (S,) int32 on the CPU. Padding rows (a replay's beyond its mapping) read -1
        here, but their values are free (harness.layer.layer_judge judges the first len(mapping) rows)."""
        size = step.get("size", len(step["mapping"]))
        m = torch.full((size,), -1, dtype=torch.int32)
        for t, s in enumerate(step["mapping"]):
            if s >= 0 and self.slots[s] is not None:
                m[t] = s
        return m
