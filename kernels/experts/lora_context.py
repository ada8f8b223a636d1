"""`MoELoRAContext`: everything the LoRA side of one expert layer needs, handed over explicitly.

The kernel object passes it into each experts stage's apply (no global or monkey-patched state), so two
layers with different contexts in one process never see each other's adapters. Validated on construction.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def _stack(ws, name: str, n: int | None) -> list:
    if not isinstance(ws, (list, tuple)) or not ws:
        raise TypeError(f"{name} must be a non-empty list of 4-D tensors; got {type(ws).__name__}")
    if n is not None and len(ws) != n:
        raise ValueError(f"{name} must hold {n} slice(s); got {len(ws)}")
    for i, w in enumerate(ws):
        if not isinstance(w, torch.Tensor) or w.dim() != 4:
            raise ValueError(f"{name}[{i}] must be a 4-D tensor; got {getattr(w, 'shape', type(w).__name__)}")
        if w.shape != ws[0].shape or w.dtype != ws[0].dtype:
            raise ValueError(f"{name}[{i}] has shape {tuple(w.shape)} / {w.dtype}; every slice must match "
                             f"{name}[0] {tuple(ws[0].shape)} / {ws[0].dtype}")
    return list(ws)


def _int_map(t, name: str, expect: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
        raise TypeError(f"{name} must be a 1-D int32 tensor {expect}; got "
                        f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")


# Dual stream pays only while the base GEMMs leave SMs idle. On the H200 the aux-stream LoRA hid 8-67% of
# the LoRA time at T <= 16 (mixtral, gpt-oss; qwen3 -1..21%), -5..12% at T = 128, and cost 12-40% of it at
# T >= 1024 (bench/results/2026-11-29-h200-s3/bench_dual_stream.md): batches above this run on one stream.
DUAL_STREAM_MAX_TOKENS = 128


@dataclass
class MoELoRAContext:
    """The LoRA state of one expert layer (spec 8's fields) plus `dual_stream` (reserved for dual-stream runs).

    `dual_stream_max_tokens` (not in vLLM): a dual-stream layer runs batches of more tokens on one stream
    (None: every batch on two); the default is the H200 crossover, DUAL_STREAM_MAX_TOKENS.

    Weights: w13 A S x (L, E|1, R, H), w13 B S x (L, E|1, N, R), w2 A 1 x (L, E, R, I), w2 B 1 x (L, E|1, H', R)
    (expert dim 1 = shared, allowed only with enable_moe_shared_loras). `token_lora_mapping` (T,) int32
    gives each token's slot in [0, L) or -1; under EP `local_token_lora_mapping` replaces it.
    `lora_collective` (fully_sharded only; not in vLLM, which always uses its TP group) joins the shrink
    outputs across TP ranks: (cache, "w13") all-gathers the rank dim, (cache, "w2") all-reduces; None uses
    torch.distributed's default group (identity on one rank). The harness passes one to simulate ranks.
    `original_hidden_states` is set by FusedMoEKernel.apply around the experts call (the unweighted,
    unquantized input the w13 LoRA reads). `punica_wrapper`/`use_tuned_config` are carried for parity
    with the production context and unused here (there is no punica layer and no tuned-config table).
    """

    w13_lora_a_stacked: list
    w13_lora_b_stacked: list
    w2_lora_a_stacked: list
    w2_lora_b_stacked: list
    adapter_enabled: torch.Tensor
    max_loras: int
    top_k: int
    w13_num_slices: int
    local_num_experts: int
    token_lora_mapping: torch.Tensor
    fully_sharded: bool = False
    tp_rank: int = 0
    tp_size: int = 1
    local_token_lora_mapping: torch.Tensor | None = None
    enable_moe_shared_loras: bool = False
    punica_wrapper: object = None
    use_tuned_config: bool = False
    aux_stream: object = None
    events: object = None
    original_hidden_states: torch.Tensor | None = None
    dual_stream: bool = False
    dual_stream_max_tokens: int | None = DUAL_STREAM_MAX_TOKENS
    lora_collective: object = None  # fully_sharded: (cache, "w13"|"w2") -> joined cache; None = torch.distributed

    def __post_init__(self):
        for name in ("max_loras", "top_k", "w13_num_slices", "local_num_experts", "tp_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MoELoRAContext.{name} must be an int >= 1; got {v!r}")
        if self.w13_num_slices not in (1, 2):
            raise ValueError(f"MoELoRAContext.w13_num_slices must be 2 (gated) or 1 (non-gated / 3-D); "
                             f"got {self.w13_num_slices}")
        if isinstance(self.tp_rank, bool) or not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"MoELoRAContext.tp_rank must be an int in [0, tp_size={self.tp_size}); got {self.tp_rank!r}")
        for name in ("fully_sharded", "enable_moe_shared_loras", "use_tuned_config", "dual_stream"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"MoELoRAContext.{name} must be a bool; got {getattr(self, name)!r}")
        mt = self.dual_stream_max_tokens
        if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 0):
            raise ValueError(f"MoELoRAContext.dual_stream_max_tokens must be None or an int >= 0; got {mt!r}")
        if self.lora_collective is not None and not callable(self.lora_collective):
            raise TypeError(f"MoELoRAContext.lora_collective must be a callable (cache, 'w13'|'w2') -> cache or "
                            f"None; got {type(self.lora_collective).__name__}")
        S, L, E = self.w13_num_slices, self.max_loras, self.local_num_experts
        a13 = _stack(self.w13_lora_a_stacked, "w13_lora_a_stacked", S)
        b13 = _stack(self.w13_lora_b_stacked, "w13_lora_b_stacked", S)
        a2 = _stack(self.w2_lora_a_stacked, "w2_lora_a_stacked", 1)
        b2 = _stack(self.w2_lora_b_stacked, "w2_lora_b_stacked", 1)
        dt = a13[0].dtype
        R = int(a2[0].shape[2])
        for name, ws in (("w13_lora_a_stacked", a13), ("w13_lora_b_stacked", b13),
                         ("w2_lora_a_stacked", a2), ("w2_lora_b_stacked", b2)):
            w = ws[0]
            if w.dtype != dt:
                raise TypeError(f"{name} has dtype {w.dtype}; every LoRA weight must share w13_lora_a's dtype {dt}")
            if w.shape[0] != L:
                raise ValueError(f"{name}[0].shape[0] must be max_loras={L}; got {tuple(w.shape)}")
            if w.shape[1] not in (1, E):
                raise ValueError(f"{name}[0].shape[1] must be local_num_experts={E} (or 1 when shared); "
                                 f"got {tuple(w.shape)}")
            if w.shape[1] == 1 and E > 1 and not self.enable_moe_shared_loras:
                raise ValueError(f"{name} has expert dim 1 (a shared LoRA) but enable_moe_shared_loras=False")
        if a2[0].shape[1] != E:
            raise ValueError(f"w2_lora_a_stacked[0] must be (L, E={E}, R, I) (never shared); got {tuple(a2[0].shape)}")
        rank_a13 = int(a13[0].shape[2])
        if b13[0].shape[3] != R or b2[0].shape[3] != R:
            raise ValueError(f"LoRA B factors must have rank R={R} (from w2_lora_a_stacked) in their last dim; "
                             f"got w13_lora_b {tuple(b13[0].shape)}, w2_lora_b {tuple(b2[0].shape)}")
        expect_a13 = R // self.tp_size if self.fully_sharded else R
        if rank_a13 != expect_a13 or (self.fully_sharded and R % self.tp_size):
            raise ValueError(f"w13_lora_a_stacked rank dim must be {expect_a13} (R={R}"
                             f"{', sliced by tp_size' if self.fully_sharded else ''}); got {tuple(a13[0].shape)}")
        I, N = int(a2[0].shape[3]), int(b13[0].shape[2])
        if not (N == I or (S == 1 and N == 2 * I)):
            raise ValueError(f"w13_lora_b_stacked's N must be I={I} (w2_lora_a_stacked's input dim), or 2I for a "
                             f"single 3-D slice; got w13_lora_b {tuple(b13[0].shape)}, w2_lora_a {tuple(a2[0].shape)}")
        en = self.adapter_enabled
        if not isinstance(en, torch.Tensor) or en.dtype != torch.int32 or tuple(en.shape) != (L + 1,):
            raise TypeError(f"adapter_enabled must be an int32 tensor of shape (max_loras+1,)=({L + 1},); got "
                            f"{getattr(en, 'dtype', type(en).__name__)} {tuple(getattr(en, 'shape', ()))}")
        _int_map(self.token_lora_mapping, "token_lora_mapping", "(T,)")
        if self.local_token_lora_mapping is not None:
            _int_map(self.local_token_lora_mapping, "local_token_lora_mapping", "(T_local,)")
        dev = a13[0].device
        for name, t in (("w13_lora_b_stacked", b13[0]), ("w2_lora_a_stacked", a2[0]), ("w2_lora_b_stacked", b2[0]),
                        ("adapter_enabled", en), ("token_lora_mapping", self.token_lora_mapping)):
            if t.device != dev:
                raise ValueError(f"{name} is on {t.device}; every LoRA tensor must be on {dev} like w13_lora_a_stacked")

    @property
    def mapping(self) -> torch.Tensor:
        """The token -> slot map the kernels use: the EP-dispatched local one when present."""
        return self.local_token_lora_mapping if self.local_token_lora_mapping is not None else self.token_lora_mapping

    @property
    def max_lora_rank(self) -> int:
        """R, the (padded) LoRA rank of the stacked buffers."""
        return int(self.w2_lora_a_stacked[0].shape[2])

    @property
    def dtype(self) -> torch.dtype:
        """The LoRA weights' dtype (must equal the activations' dtype)."""
        return self.w13_lora_a_stacked[0].dtype

    def w13_lora_input(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """What the w13 LoRA reads: the original (unweighted) hidden states FusedMoEKernel stashed, else these."""
        return self.original_hidden_states if self.original_hidden_states is not None else hidden_states
