"""The modular expert layer: `FusedMoEExperts` (capabilities as data, one `is_supported_config`) and
`FusedMoEKernel` (prepare/finalize + experts, LoRA context passed explicitly).

A backend states what it runs as class attributes; `is_supported_config` reads only those, in a fixed
order (spec 8), and returns the first failing reason, so an oracle that consults it cannot skip a check.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Mapping

import torch

from moe_lora_harness.kernels.experts.config import MoEConfig
from moe_lora_harness.kernels.experts.lora_context import MoELoRAContext
from moe_lora_harness.kernels.triton.platform import interpreting
from moe_lora_harness.kernels.triton.quant_gemm import QuantWeights
from moe_lora_harness.kernels.validate import checks_enabled


@dataclass(frozen=True)
class ShapeRule:
    """A declared shape/size constraint: `holds(config)` must be true; `reason` says why it exists."""

    name: str
    holds: Callable[[MoEConfig], bool]
    reason: str


class FusedMoEExperts:
    """Base of every experts stage. Subclasses declare capabilities as class data and implement `apply`.

    Data: devices, dtypes (device -> dtype names) with dtype_reasons, activations, supports_non_gated,
    quant_schemes, supports_bias, supports_ep, supports_fully_sharded, max_lora_rank (None = any) and
    shape_rules. LoRA support is `supports_lora()` (False here; LoRAExpertsMixin turns it on).
    Construction does not consult is_supported_config (the oracle does), so a harness can probe a
    declined config; a class refuses at construction only what it cannot compute at all.
    """

    name: ClassVar[str] = "abstract"
    devices: ClassVar[frozenset] = frozenset()
    dtypes: ClassVar[Mapping] = {}
    dtype_reasons: ClassVar[Mapping] = {}
    activations: ClassVar[frozenset] = frozenset()
    supports_non_gated: ClassVar[bool] = False
    quant_schemes: ClassVar[frozenset] = frozenset({"none"})
    supports_bias: ClassVar[bool] = False
    supports_ep: ClassVar[bool] = False
    supports_fully_sharded: ClassVar[bool] = False
    max_lora_rank: ClassVar[int | None] = None
    shape_rules: ClassVar[tuple] = ()

    def __init__(self, config: MoEConfig):
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a kernels.experts.config.MoEConfig; got {type(config).__name__}")
        self.config = config

    @classmethod
    def supports_lora(cls) -> bool:
        """Whether this experts stage applies LoRA (False unless LoRAExpertsMixin is mixed in)."""
        return False

    @classmethod
    def is_supported_config(cls, config: MoEConfig) -> tuple[bool, str]:
        """(ok, reason) from the declarations alone, checked in spec 8's order; reason names the first failure.

        Order: device, dtype on that device, gated-or-no-mul, activation, quant scheme, parallel config
        (EP, fully sharded), bias, shape rules, and last LoRA (enabled but unsupported, rank limit).
        """
        c = config
        if c.device not in cls.devices:
            return False, f"device {c.device} not supported (devices: {sorted(cls.devices)})"
        if c.device == "cpu" and not interpreting():
            return False, "device cpu needs the Triton interpreter (TRITON_INTERPRET=1)"
        if c.dtype_name not in cls.dtypes.get(c.device, frozenset()):
            why = cls.dtype_reasons.get((c.device, c.dtype_name), "not declared")
            return False, f"{c.dtype_name} on {c.device}: {why}"
        if not c.gated and not cls.supports_non_gated:
            return False, f"non-gated activation {c.activation} not supported (gated act-and-mul only)"
        if c.activation not in cls.activations:
            return False, f"activation {c.activation} not supported (supported: {sorted(cls.activations)})"
        if c.quant not in cls.quant_schemes:
            return False, f"quant scheme {c.quant} not supported (supported: {sorted(cls.quant_schemes)})"
        if c.expert_map and not cls.supports_ep:
            return False, "expert_map (expert parallel) not supported"
        if c.fully_sharded and not cls.supports_fully_sharded:
            return False, "fully_sharded LoRA not supported"
        if c.has_bias and not cls.supports_bias:
            return False, "biases not supported"
        for rule in cls.shape_rules:
            if not rule.holds(c):
                return False, f"{rule.name}: {rule.reason}"
        if c.lora_enabled and not cls.supports_lora():
            return False, "LoRA enabled but this backend does not support LoRA"
        if c.lora_enabled and cls.max_lora_rank is not None and c.max_lora_rank > cls.max_lora_rank:
            return False, f"max_lora_rank {c.max_lora_rank} > supported {cls.max_lora_rank}"
        return True, ""

    def apply(self, output, hidden_states, w13, w2, topk_weights, topk_ids, *, expert_map=None,
              w13_bias=None, w2_bias=None, lora_ctx: MoELoRAContext | None = None) -> None:
        """Write the (T, H) expert output into `output` in place (subclasses implement it)."""
        raise NotImplementedError(f"{type(self).__name__}.apply")


# ----------------------------------------------------------------------------- argument checks


def _tensor(t, name: str, shape: tuple, dtype, device_type: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shape}, dtype {dtype}; got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}; got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}; got {t.dtype}")
    if t.device.type != device_type:
        raise ValueError(f"{name} must be on a {device_type} device (config.device); got {t.device}")


def local_expert_ids(topk_ids: torch.Tensor, expert_map) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(local ids (T, k) int32, -1 = non-local; valid = local >= 0, or None when every pair is local)."""
    if expert_map is None:
        return topk_ids, None
    local = expert_map[topk_ids.long()].to(torch.int32)
    return local, local >= 0


def check_activations_and_routing(config: MoEConfig, output, hidden_states, topk_weights, topk_ids,
                                  expert_map) -> int:
    """Validate output/hidden/routing/expert_map against the config (shapes, dtypes, devices); returns T."""
    c, dev = config, config.device
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be a 2-D tensor (T, H={c.H}); got "
                         f"{getattr(hidden_states, 'shape', type(hidden_states).__name__)}")
    T = int(hidden_states.shape[0])
    _tensor(hidden_states, "hidden_states", (T, c.H), c.dtype, dev)
    _tensor(output, "output", (T, c.H), c.dtype, dev)
    _tensor(topk_ids, "topk_ids", (T, c.top_k), torch.int32, dev)
    if not isinstance(topk_weights, torch.Tensor) or not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be a floating-point tensor (T={T}, k={c.top_k}); got "
                        f"{getattr(topk_weights, 'dtype', type(topk_weights).__name__)}")
    _tensor(topk_weights, "topk_weights", (T, c.top_k), None, dev)
    if (expert_map is not None) != c.expert_map:
        raise ValueError(f"expert_map must be {'given' if c.expert_map else 'None'} (config.expert_map="
                         f"{c.expert_map}); got {'None' if expert_map is None else 'a tensor'}")
    if expert_map is not None:
        if not isinstance(expert_map, torch.Tensor) or expert_map.dim() != 1 or expert_map.dtype != torch.int32:
            raise TypeError(f"expert_map must be a 1-D int32 tensor (E_global,); got "
                            f"{getattr(expert_map, 'dtype', type(expert_map).__name__)}")
        if expert_map.device.type != dev:
            raise ValueError(f"expert_map must be on a {dev} device; got {expert_map.device}")
    return T


def check_dense_weights(config: MoEConfig, w13, w2, w13_bias, w2_bias) -> None:
    """Validate unquantized weights and biases: w13 (E, N1, H), w2 (E, H, I), biases (E, N1) / (E, H)."""
    c, dev = config, config.device
    _tensor(w13, "w13", (c.E, c.N1, c.H), c.dtype, dev)
    _tensor(w2, "w2", (c.E, c.H, c.I), c.dtype, dev)
    check_biases(config, w13_bias, w2_bias)


def check_quant_weights(config, w13, w2) -> None:
    """w13 / w2 must be QuantWeights of config.quant with logical shapes (E, N1, H) and (E, H, I)."""
    c = config
    for name, qw, shape in (("w13", w13, (c.E, c.N1, c.H)), ("w2", w2, (c.E, c.H, c.I))):
        if not isinstance(qw, QuantWeights):
            raise TypeError(f"{name} must be a kernels.triton.quant_gemm.QuantWeights (pack_weights) for "
                            f"quant={c.quant!r}; got {type(qw).__name__}")
        if qw.scheme != c.quant:
            raise ValueError(f"{name}.scheme must be config.quant={c.quant!r}; got {qw.scheme!r}")
        if (qw.num_experts, qw.N, qw.K) != shape:
            raise ValueError(f"{name} must have logical shape (E, N, K) = {shape}; got "
                             f"({qw.num_experts}, {qw.N}, {qw.K})")
        if qw.device.type != c.device:
            raise ValueError(f"{name} must be on a {c.device} device; got {qw.device}")


def check_biases(config: MoEConfig, w13_bias, w2_bias) -> None:
    """Biases are given exactly when config.has_bias; shapes (E, N1) and (E, H) in the config dtype."""
    c = config
    if (w13_bias is None) != (w2_bias is None) or (w13_bias is not None) != c.has_bias:
        raise ValueError(f"w13_bias and w2_bias must both be {'given' if c.has_bias else 'None'} "
                         f"(config.has_bias={c.has_bias})")
    if w13_bias is not None:
        _tensor(w13_bias, "w13_bias", (c.E, c.N1), c.dtype, c.device)
        _tensor(w2_bias, "w2_bias", (c.E, c.H), c.dtype, c.device)


def check_lora_ctx(config: MoEConfig, lora_ctx, T: int, supports_lora: bool) -> None:
    """The context matches the layer: given iff LoRA is enabled, shapes/dtype/device agree with the config."""
    c = config
    if lora_ctx is None:
        if c.lora_enabled:
            raise ValueError("lora_ctx must be a MoELoRAContext when config.lora_enabled is True")
        return
    if not isinstance(lora_ctx, MoELoRAContext):
        raise TypeError(f"lora_ctx must be a MoELoRAContext or None; got {type(lora_ctx).__name__}")
    if not supports_lora:
        raise ValueError("lora_ctx given but these experts do not support LoRA (supports_lora() is False)")
    if not c.lora_enabled:
        raise ValueError("lora_ctx given but config.lora_enabled is False")
    if lora_ctx.dtype != c.dtype:
        raise TypeError(f"LoRA weights must have the activations' dtype {c.dtype}; got {lora_ctx.dtype}")
    if lora_ctx.w13_lora_a_stacked[0].device.type != c.device:
        raise ValueError(f"LoRA weights must be on a {c.device} device; got {lora_ctx.w13_lora_a_stacked[0].device}")
    if lora_ctx.local_num_experts != c.E or lora_ctx.top_k != c.top_k:
        raise ValueError(f"lora_ctx.local_num_experts/top_k must be E={c.E}/top_k={c.top_k}; got "
                         f"{lora_ctx.local_num_experts}/{lora_ctx.top_k}")
    if lora_ctx.max_lora_rank != c.max_lora_rank:
        raise ValueError(f"lora_ctx rank {lora_ctx.max_lora_rank} must equal config.max_lora_rank={c.max_lora_rank}")
    if lora_ctx.fully_sharded != c.fully_sharded:
        raise ValueError(f"lora_ctx.fully_sharded={lora_ctx.fully_sharded} must equal config.fully_sharded")
    want_s = 2 if c.gated else 1
    if lora_ctx.w13_num_slices != want_s and not (lora_ctx.w13_num_slices == 1 and c.gated):
        raise ValueError(f"lora_ctx.w13_num_slices must be {want_s} for activation {c.activation}")
    H, I = c.H, c.I
    a13, b13 = lora_ctx.w13_lora_a_stacked[0], lora_ctx.w13_lora_b_stacked[0]
    n_w13 = I if lora_ctx.w13_num_slices == 2 or not c.gated else 2 * I
    if a13.shape[3] != H or b13.shape[2] != n_w13:
        raise ValueError(f"w13 LoRA must be A (L, E, R, H={H}) and B (L, E, N={n_w13}, R); got "
                         f"{tuple(a13.shape)} and {tuple(b13.shape)}")
    a2, b2 = lora_ctx.w2_lora_a_stacked[0], lora_ctx.w2_lora_b_stacked[0]
    h2 = H // lora_ctx.tp_size if lora_ctx.fully_sharded else H
    if a2.shape[3] != I or b2.shape[2] != h2:
        raise ValueError(f"w2 LoRA must be A (L, E, R, I={I}) and B (L, E, H={h2}, R); got "
                         f"{tuple(a2.shape)} and {tuple(b2.shape)}")
    m = lora_ctx.mapping
    if m.shape[0] != T:
        raise ValueError(f"lora_ctx.{'local_' if lora_ctx.local_token_lora_mapping is not None else ''}"
                         f"token_lora_mapping must have shape (T,)=({T},); got {tuple(m.shape)}")
    if m.device.type != c.device:
        raise ValueError(f"token_lora_mapping must be on a {c.device} device; got {m.device}")


def check_id_ranges(config: MoEConfig, topk_ids, expert_map, lora_ctx) -> None:
    """Id VALUES (one device sync): topk_ids in [0, E_global), expert_map in [-1, E), mapping in [-1, L).

    Skipped while a CUDA graph is being captured and when MOE_LORA_UNCHECKED=1.
    """
    if topk_ids.numel() == 0 or not checks_enabled(topk_ids.device):
        return
    E_global = int(expert_map.numel()) if expert_map is not None else config.E
    parts = [topk_ids.min().reshape(1).long(), topk_ids.max().reshape(1).long()]
    if expert_map is not None:
        parts += [expert_map.min().reshape(1).long(), expert_map.max().reshape(1).long()]
    if lora_ctx is not None:
        m = lora_ctx.mapping
        parts += [m.min().reshape(1).long(), m.max().reshape(1).long()]
    v = torch.cat(parts).tolist()
    if v[0] < 0 or v[1] >= E_global:
        raise ValueError(f"topk_ids must hold expert ids in [0, {E_global}); got values in [{v[0]}, {v[1]}]")
    i = 2
    if expert_map is not None:
        if v[2] < -1 or v[3] >= config.E:
            raise ValueError(f"expert_map must hold local ids in [0, E={config.E}) or -1; got [{v[2]}, {v[3]}]")
        i = 4
    if lora_ctx is not None and (v[i] < -1 or v[i + 1] >= lora_ctx.max_loras):
        raise ValueError(f"token_lora_mapping must hold slots in [-1, max_loras={lora_ctx.max_loras}); "
                         f"got [{v[i]}, {v[i + 1]}]")


# ----------------------------------------------------------------------------- the kernel


class FusedMoEKernel:
    """prepare_finalize + experts: `apply` prepares the input, runs the experts with the LoRA context
    passed explicitly (original hidden states stashed on it for the call), then finalizes."""

    def __init__(self, prepare_finalize, experts: FusedMoEExperts):
        if not isinstance(experts, FusedMoEExperts):
            raise TypeError(f"experts must be a FusedMoEExperts instance; got {type(experts).__name__}")
        for m in ("prepare", "finalize"):
            if not callable(getattr(prepare_finalize, m, None)):
                raise TypeError(f"prepare_finalize must provide {m}(...); got {type(prepare_finalize).__name__}")
        self.prepare_finalize = prepare_finalize
        self.experts = experts

    @property
    def config(self) -> MoEConfig:
        """The experts stage's MoEConfig."""
        return self.experts.config

    def supports_lora(self) -> bool:
        """Delegates to the experts stage."""
        return self.experts.supports_lora()

    def apply(self, hidden_states, w13, w2, topk_weights, topk_ids, *, lora_ctx: MoELoRAContext | None = None,
              expert_map=None, w13_bias=None, w2_bias=None, output=None) -> torch.Tensor:
        """The layer's (T, H) expert output (written into `output` when given, else a new tensor)."""
        if lora_ctx is not None and not self.supports_lora():
            raise ValueError(f"lora_ctx given but {type(self.experts).__name__} does not support LoRA")
        if output is None:
            if not isinstance(hidden_states, torch.Tensor):
                raise TypeError(f"hidden_states must be a torch.Tensor; got {type(hidden_states).__name__}")
            output = torch.empty_like(hidden_states)
        final = output
        if getattr(self.prepare_finalize, "dispatches", False):
            # a dispatching prepare (EP): it returns the group's gathered batch (and sets the context's
            # local mapping); the experts write a gathered-size buffer, finalize returns this rank's rows
            a1, hidden_states, topk_weights, topk_ids = self.prepare_finalize.prepare(
                hidden_states, topk_weights, topk_ids, self.config, lora_ctx=lora_ctx)
            output = torch.empty_like(hidden_states)
        else:
            a1 = self.prepare_finalize.prepare(hidden_states, topk_weights, topk_ids, self.config)
        saved = None
        if lora_ctx is not None:
            saved = lora_ctx.original_hidden_states
            lora_ctx.original_hidden_states = hidden_states
        try:
            self.experts.apply(output, a1, w13, w2, topk_weights, topk_ids, expert_map=expert_map,
                               w13_bias=w13_bias, w2_bias=w2_bias, lora_ctx=lora_ctx)
        finally:
            if lora_ctx is not None:
                lora_ctx.original_hidden_states = saved
        out = self.prepare_finalize.finalize(output, self.config)
        if out is not final:
            final.copy_(out)
        return final
