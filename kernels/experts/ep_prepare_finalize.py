"""Naive expert-parallel prepare/finalize with LoRA (vLLM's DP attention + EP MoE, all-gather / reduce-scatter).

Each rank of an EP group of size ep holds its own tokens, their router outputs (topk ids are GLOBAL expert
ids) and token -> LoRA slot mapping. `prepare` all-gathers hidden states, topk weights and ids across the
group, with the mapping dispatched beside them in the same collective, and sets the LoRA context's
`local_token_lora_mapping` to the dispatched mapping (row t of the gathered batch keeps its own adapter);
the experts run this rank's E/ep local experts (`expert_map`) over the gathered batch; `finalize`
reduce-scatters the partial outputs (fp32 accumulate, one rounding) so each rank gets back its own tokens.
`FusedMoEKernel.apply` recognizes it by `dispatches = True`. Ranks may hold uneven token counts, 0 included.

`comm` is any object with `rank`, `size`, `all_gather(list of tensors)` (concatenate along dim 0 over the
ranks, uneven first dims allowed) and `reduce_scatter(t, sizes)` (fp32 sum over the ranks, one rounding to
t.dtype, this rank's rows); the harness's `harness.communicator` has a torch.distributed one and a simulated
one. `slice_lora_to_local` cuts a rank's local experts out of LoRA factors that hold the global experts.
"""
from __future__ import annotations

import torch

from moe_lora_harness.kernels.experts.config import MoEConfig
from moe_lora_harness.kernels.experts.lora_context import MoELoRAContext

__all__ = ["NaiveEPPrepareAndFinalize", "ep_local_expert_map", "slice_lora_to_local"]


def _ep_args(ep_size, ep_rank, num_experts_global) -> int:
    for name, v in (("ep_size", ep_size), ("num_experts_global", num_experts_global)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1; got {v!r}")
    if isinstance(ep_rank, bool) or not isinstance(ep_rank, int) or not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank must be an int in [0, ep_size={ep_size}); got {ep_rank!r}")
    if num_experts_global % ep_size:
        raise ValueError(f"num_experts_global={num_experts_global} is not divisible by ep_size={ep_size}: with LoRA "
                         "the adapters are sliced [rank*E/ep, (rank+1)*E/ep), which needs an even split")
    return num_experts_global // ep_size


def ep_local_expert_map(num_experts_global: int, ep_size: int, ep_rank: int) -> torch.Tensor:
    """int32 (E_global,) map: global id -> local id on ep_rank (experts [rank*E/ep, (rank+1)*E/ep)), -1 elsewhere."""
    n = _ep_args(ep_size, ep_rank, num_experts_global)
    emap = torch.full((num_experts_global,), -1, dtype=torch.int32)
    emap[ep_rank * n:(ep_rank + 1) * n] = torch.arange(n, dtype=torch.int32)
    return emap


def slice_lora_to_local(w13_a, w13_b, w2_a, w2_b, *, ep_rank: int, ep_size: int,
                        num_experts_global: int | None = None) -> tuple[list, list, list, list]:
    """This EP rank's LoRA factors from factors holding the global experts (L, E_global|1, ., .).

    Experts [start, start + E/ep) with start = ep_rank * E/ep of every w13 A/B slice (2 gated, 1 non-gated)
    and of w2 A/B; a shared factor (expert dim 1) is kept whole. E_global defaults to the largest expert dim.
    Returns (w13_a, w13_b, w2_a, w2_b) as lists of contiguous tensors.
    """
    groups = {"w13_a": list(w13_a), "w13_b": list(w13_b), "w2_a": list(w2_a), "w2_b": list(w2_b)}
    for name, ws in groups.items():
        if not ws or any(not isinstance(w, torch.Tensor) or w.dim() != 4 for w in ws):
            raise ValueError(f"{name} must be a non-empty list of 4-D tensors (L, E, ., .)")
    if len(groups["w13_a"]) != len(groups["w13_b"]) or len(groups["w13_a"]) not in (1, 2):
        raise ValueError(f"w13_a and w13_b must hold the same number of slices (2 gated, 1 non-gated); got "
                         f"{len(groups['w13_a'])} and {len(groups['w13_b'])}")
    if len(groups["w2_a"]) != 1 or len(groups["w2_b"]) != 1:
        raise ValueError("w2_a and w2_b must hold one slice each")
    E = num_experts_global if num_experts_global is not None else max(
        int(w.shape[1]) for ws in groups.values() for w in ws)
    n = _ep_args(ep_size, ep_rank, E)
    lo, hi = ep_rank * n, (ep_rank + 1) * n

    def cut(name: str, w: torch.Tensor) -> torch.Tensor:
        e = int(w.shape[1])
        if e == 1 and E > 1:
            return w.contiguous()   # shared across experts
        if e != E:
            raise ValueError(f"{name} has expert dim {e}; expected num_experts_global={E} (or 1 when shared)")
        return w[:, lo:hi].contiguous()

    out = tuple([cut(name, w) for w in ws] for name, ws in groups.items())
    return out  # type: ignore[return-value]


class NaiveEPPrepareAndFinalize:
    """All-gather dispatch / reduce-scatter combine over `comm` (a Communicator); see the module doc.

    `fully_sharded=True` is rejected (vLLM rejects EP with fully-sharded LoRA), as is a num_experts_global
    not divisible by the group size. `expert_map` is this rank's global -> local map to pass to the kernel.
    """

    dispatches = True

    def __init__(self, comm, num_experts_global: int, *, fully_sharded: bool = False):
        for attr in ("rank", "size", "all_gather", "reduce_scatter"):
            if not hasattr(comm, attr):
                raise TypeError(f"comm must be a Communicator (rank, size, all_gather, reduce_scatter); "
                                f"{type(comm).__name__} lacks {attr}")
        if fully_sharded:
            raise ValueError("fully_sharded=True: expert parallelism with fully-sharded LoRA is not supported "
                             "(vLLM rejects EP with fully_sharded_loras)")
        self.local_num_experts = _ep_args(comm.size, comm.rank, num_experts_global)
        self.comm = comm
        self.num_experts_global = num_experts_global
        self.expert_map = ep_local_expert_map(num_experts_global, comm.size, comm.rank)
        self.tokens_per_rank: list[int] | None = None

    @property
    def ep_rank(self) -> int:
        return self.comm.rank

    @property
    def ep_size(self) -> int:
        return self.comm.size

    def _check(self, hidden_states, topk_weights, topk_ids, config: MoEConfig, lora_ctx) -> int:
        r = self.comm.rank
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2:
            raise ValueError(f"hidden_states (rank {r}) must be a 2-D tensor (T, H={config.H}); got "
                             f"{getattr(hidden_states, 'shape', type(hidden_states).__name__)}")
        T = int(hidden_states.shape[0])
        if int(hidden_states.shape[1]) != config.H:
            raise ValueError(f"hidden_states (rank {r}) has hidden size {hidden_states.shape[1]}; expected "
                             f"H={config.H}")
        if hidden_states.dtype != config.dtype:
            raise ValueError(f"hidden_states (rank {r}) has dtype {hidden_states.dtype}; expected {config.dtype}")
        for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (T, config.top_k):
                raise ValueError(f"{name} (rank {r}) must have shape (T={T}, top_k={config.top_k}) like this "
                                 f"rank's hidden states; got {tuple(getattr(t, 'shape', ()))}")
        if topk_ids.dtype != torch.int32:
            raise ValueError(f"topk_ids (rank {r}) must be int32; got {topk_ids.dtype}")
        if config.E != self.local_num_experts or not config.expert_map:
            raise ValueError(f"config (rank {r}) must describe the local layer: E=local_num_experts="
                             f"{self.local_num_experts} and expert_map=True; got E={config.E}, "
                             f"expert_map={config.expert_map}")
        if lora_ctx is not None:
            if lora_ctx.fully_sharded:
                raise ValueError(f"lora_ctx.fully_sharded (rank {r}): EP with fully-sharded LoRA is not supported")
            m = lora_ctx.token_lora_mapping
            if m.shape[0] != T:
                raise ValueError(f"token_lora_mapping (rank {r}) has length {m.shape[0]}; expected this rank's "
                                 f"token count T={T}")
        return T

    def dispatch(self, hidden_states, topk_weights, topk_ids, extras=()):
        """One all-gather of [counts, hidden, topk_weights, topk_ids, *extras]; returns (hidden, topk_weights,
        topk_ids, extras list, tokens_per_rank), all in rank order."""
        T = int(hidden_states.shape[0])
        count = torch.tensor([T], dtype=torch.int64, device=hidden_states.device)
        got = self.comm.all_gather([count, hidden_states, topk_weights, topk_ids, *extras])
        sizes = [int(v) for v in got[0].tolist()]
        return got[1], got[2], got[3], list(got[4:]), sizes

    def prepare(self, hidden_states, topk_weights, topk_ids, config: MoEConfig, *,
                lora_ctx: MoELoRAContext | None = None):
        """(experts' input, gathered hidden states, gathered topk weights, gathered topk ids); sets
        lora_ctx.local_token_lora_mapping to the dispatched mapping."""
        self._check(hidden_states, topk_weights, topk_ids, config, lora_ctx)
        extras = [lora_ctx.token_lora_mapping] if lora_ctx is not None else []
        x, w, ids, ex, sizes = self.dispatch(hidden_states, topk_weights, topk_ids, extras)
        self.tokens_per_rank = sizes
        if lora_ctx is not None:
            lora_ctx.local_token_lora_mapping = ex[0]
        a1 = x
        if config.apply_router_weight_on_input:
            a1 = x * w.to(x.dtype)
        return a1, x, w, ids

    def finalize(self, output: torch.Tensor, config: MoEConfig) -> torch.Tensor:
        """This rank's rows of the sum of every rank's (T_gathered, H) partial output."""
        if self.tokens_per_rank is None:
            raise RuntimeError(f"finalize (rank {self.comm.rank}) called before prepare")
        sizes, self.tokens_per_rank = self.tokens_per_rank, None
        return self.comm.reduce_scatter(output, sizes)
