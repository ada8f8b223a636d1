"""MoE LoRA adapters and their packing into the stacked per-slot buffers (spec 4.1).

An `ExpertAdapter` holds one adapter's per-expert factors as a model checkpoint would; `pack_moe_lora`
loads several of them into the `(L, E, R, ...)` buffers the kernels read, the way `set_lora` does:
cast to the LoRA dtype, scaling folded into B in that dtype, smaller ranks zero-padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ExpertAdapter", "StackedMoELoRA", "pack_moe_lora"]


def _check_shape(name: str, t: Tensor, expected: tuple[int, ...]) -> None:
    """Raise ValueError naming `name` unless `t` has exactly `expected` shape."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {expected}, got {type(t).__name__}")
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


@dataclass
class ExpertAdapter:
    """One LoRA adapter of an MoE layer with per-expert factors (checkpoint layout, unscaled).

    A factors are (E, r, in), B factors (E, out, r). `gate_*` is w1 (gate_proj; the only w13 factor
    of a non-gated model), `up_*` is w3 (up_proj; None for non-gated models), `down_*` is w2.
    The w13 factors (gate, up) share one rank, the w2 (down) factors may have another (PEFT's
    conversion of per-expert targets: gate_up 2r, down r). `scaling` is the w13 modules' scaling;
    `down_scaling` the w2 module's (None: the same as `scaling`).
    """

    gate_a: Tensor  # (E, r13, H)
    gate_b: Tensor  # (E, I, r13)
    up_a: Tensor | None  # (E, r13, H) or None
    up_b: Tensor | None  # (E, I, r13) or None
    down_a: Tensor  # (E, r2, I)
    down_b: Tensor  # (E, H, r2)
    scaling: float = 1.0
    down_scaling: float | None = None

    @property
    def w13_rank(self) -> int:
        """The rank of the gate and up factors."""
        return int(self.gate_a.shape[1])

    @property
    def w2_rank(self) -> int:
        """The rank of the down factors."""
        return int(self.down_a.shape[1])

    @property
    def rank(self) -> int:
        """The adapter's largest rank (what a slot's max_rank must hold)."""
        return max(self.w13_rank, self.w2_rank)

    @property
    def w2_scaling(self) -> float:
        """The scaling folded into the down B: `down_scaling`, or `scaling` when that is None."""
        return float(self.scaling if self.down_scaling is None else self.down_scaling)

    @property
    def gated(self) -> bool:
        """True when the adapter carries an up_proj (w3) factor pair."""
        return self.up_a is not None

    @classmethod
    def random(
        cls,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        rank: int,
        gated: bool,
        scaling: float = 1.0,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float32,
        *,
        down_rank: int | None = None,
        down_scaling: float | None = None,
        device: torch.device | str | None = None,
    ) -> ExpertAdapter:
        """Random non-trivial factors: A ~ randn/sqrt(in), B ~ randn/sqrt(rank).

        With that scaling B A x has the magnitude of x (and of a base layer with randn/sqrt(in)
        weights), so the LoRA delta is comparable to the base output rather than negligible.
        `down_rank` (None: `rank`) is the w2 factors' rank; `device` (None: CPU) is where the factors
        are drawn, with `generator` of that device.
        """
        down_rank = rank if down_rank is None else down_rank
        for name, v in (("num_experts", num_experts), ("hidden_size", hidden_size),
                        ("intermediate_size", intermediate_size), ("rank", rank), ("down_rank", down_rank)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        E, H, I = num_experts, hidden_size, intermediate_size

        def a(r: int, inp: int) -> Tensor:
            x = torch.randn(E, r, inp, generator=generator, dtype=torch.float64, device=device)
            return (x / inp**0.5).to(dtype)

        def b(out: int, r: int) -> Tensor:
            x = torch.randn(E, out, r, generator=generator, dtype=torch.float64, device=device)
            return (x / r**0.5).to(dtype)

        gate_a, gate_b = a(rank, H), b(I, rank)
        up_a, up_b = (a(rank, H), b(I, rank)) if gated else (None, None)
        down_a, down_b = a(down_rank, I), b(H, down_rank)
        return cls(gate_a, gate_b, up_a, up_b, down_a, down_b, float(scaling),
                   None if down_scaling is None else float(down_scaling))


@dataclass
class StackedMoELoRA:
    """The kernels' stacked LoRA buffers for one MoE layer (spec 4.1 table).

    `w13_a`: S x (L, E_a, R, H); `w13_b`: S x (L, E, I, R); `w2_a`: 1 x (L, E, R, I);
    `w2_b`: 1 x (L, E_b, H, R); `adapter_enabled`: (L+1,) int32. E_a = 1 for a shared A,
    E_b = 1 for a shared B. Under fully-sharded TP, w13_a holds R/tp rows and w2_b H/tp rows.
    """

    w13_a: list[Tensor]
    w13_b: list[Tensor]
    w2_a: list[Tensor]
    w2_b: list[Tensor]
    adapter_enabled: Tensor

    @property
    def max_loras(self) -> int:
        """L, the number of adapter slots."""
        return int(self.w13_b[0].shape[0])

    @property
    def max_rank(self) -> int:
        """R, the full (unsharded) padded rank (read from w2_a, never rank-sharded)."""
        return int(self.w2_a[0].shape[2])

    @property
    def num_slices(self) -> int:
        """S, the number of w13 slices (2 gated: gate, up; 1 non-gated)."""
        return len(self.w13_a)

    @property
    def num_experts(self) -> int:
        """E, the number of (local) experts (read from w13_b, never shared)."""
        return int(self.w13_b[0].shape[1])

    @property
    def shared_a(self) -> bool:
        """True when the w13 A factors are shared by all experts (expert dim 1)."""
        return int(self.w13_a[0].shape[1]) == 1 and self.num_experts > 1

    @property
    def shared_b(self) -> bool:
        """True when the w2 B factor is shared by all experts (expert dim 1)."""
        return int(self.w2_b[0].shape[1]) == 1 and self.num_experts > 1

    @property
    def dtype(self) -> torch.dtype:
        """The LoRA dtype of the buffers."""
        return self.w13_a[0].dtype

    def clone(self) -> StackedMoELoRA:
        """A deep copy (the buffers are mutable)."""
        return StackedMoELoRA(
            [t.clone() for t in self.w13_a], [t.clone() for t in self.w13_b],
            [t.clone() for t in self.w2_a], [t.clone() for t in self.w2_b],
            self.adapter_enabled.clone(),
        )


def pack_moe_lora(
    adapters: Sequence[ExpertAdapter | None],
    *,
    max_loras: int,
    max_rank: int,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    dtype: torch.dtype,
    gated: bool,
    shared_a: bool = False,
    shared_b: bool = False,
    device: torch.device | str | None = None,
) -> StackedMoELoRA:
    """Load `adapters` into slots 0.. of freshly zeroed stacked buffers, as `set_lora` does.

    Slot i holds adapters[i] (None = empty, disabled). Factors are cast to `dtype`; each B is scaled
    by its module's scaling (w13: `scaling`, w2: `w2_scaling`) in `dtype` after the cast (rounded as
    vLLM's `lora_b *= scaling`); each module's rank is copied into the top-left corner, the rest
    stays 0. The buffers are made on `device` (None: CPU). Shared buffers keep expert 0
    of the factor (src[:1]). Non-gated models get one w13 slice (w1); an adapter's up factors,
    if any, are then ignored, as vLLM does. Slice 0 is gate (w1), slice 1 up (w3).
    """
    for name, v in (("max_loras", max_loras), ("max_rank", max_rank), ("num_experts", num_experts),
                    ("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if len(adapters) > max_loras:
        raise ValueError(f"adapters has {len(adapters)} entries but max_loras={max_loras} slots")
    L, R, E, H, I = max_loras, max_rank, num_experts, hidden_size, intermediate_size
    S = 2 if gated else 1
    E_a = 1 if shared_a else E
    E_b = 1 if shared_b else E
    w13_a = [torch.zeros(L, E_a, R, H, dtype=dtype, device=device) for _ in range(S)]
    w13_b = [torch.zeros(L, E, I, R, dtype=dtype, device=device) for _ in range(S)]
    w2_a = [torch.zeros(L, E, R, I, dtype=dtype, device=device)]
    w2_b = [torch.zeros(L, E_b, H, R, dtype=dtype, device=device)]
    enabled = torch.zeros(L + 1, dtype=torch.int32, device=device)

    for i, ad in enumerate(adapters):
        if ad is None:
            continue
        if not isinstance(ad, ExpertAdapter):
            raise TypeError(f"adapters[{i}] must be an ExpertAdapter or None, got {type(ad).__name__}")
        r13, r2 = ad.w13_rank, ad.w2_rank
        if ad.rank > R:
            raise ValueError(f"adapters[{i}] has rank {ad.rank} > max_rank={R} (w13 rank {r13}, w2 rank {r2})")
        if gated and not ad.gated:
            raise ValueError(f"adapters[{i}].up_a/up_b are None but gated=True needs the up_proj (w3) factors")
        pairs = [("gate", ad.gate_a, ad.gate_b)]
        if gated:
            pairs.append(("up", ad.up_a, ad.up_b))
        for nm, a, b in pairs:
            _check_shape(f"adapters[{i}].{nm}_a", a, (E, r13, H))
            _check_shape(f"adapters[{i}].{nm}_b", b, (E, I, r13))
        _check_shape(f"adapters[{i}].down_a", ad.down_a, (E, r2, I))
        _check_shape(f"adapters[{i}].down_b", ad.down_b, (E, H, r2))

        for s, (_, a, b) in enumerate(pairs):
            w13_a[s][i, :, :r13, :] = a[:E_a].to(dtype)
            w13_b[s][i, :, :, :r13] = _scaled_b(b, float(ad.scaling), dtype)
        w2_a[0][i, :, :r2, :] = ad.down_a.to(dtype)
        w2_b[0][i, :, :, :r2] = _scaled_b(ad.down_b, ad.w2_scaling, dtype)[:E_b]
        enabled[i] = 1
    return StackedMoELoRA(w13_a, w13_b, w2_a, w2_b, enabled)


def _scaled_b(b: Tensor, scaling: float, dtype: torch.dtype) -> Tensor:
    """B cast to `dtype`, then multiplied by `scaling` in `dtype` (one rounding, like `lora_b *= scaling`)."""
    out = b.to(dtype).clone()
    out.mul_(float(scaling))
    return out
