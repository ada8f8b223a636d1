"""Naive expert-parallel prepare/finalize with LoRA (vLLM's DP attention + EP MoE, all-gather / reduce-scatter).

Each rank of an EP group of size ep holds its own tokens, their router outputs (topk ids are GLOBAL expert
ids) and token -> LoRA slot mapping. `prepare` all-gathers hidden states, topk weights and ids across the
group, with the mapping dispatched beside them in the same collective, and sets the LoRA context's
`local_token_lora_mapping` to the dispatched mapping (row t of the gathered batch keeps its own adapter);
the experts run this rank's E/ep local experts (`expert_map`) over the gathered batch; `finalize`
reduce-scatters the partial outputs (fp32 accumulate, one rounding) so each rank gets back its own tokens.
`FusedMoEKernel.apply` recognizes it by `dispatches = True`. Ranks may hold uneven token counts, 0 included.

Before the dispatch every rank runs its own argument checks and all-gathers one int64 row: the checks' result
and the layer signature the gathered batch depends on (`check_group`); any failure or disagreement makes EVERY
rank raise ValueError there, so no rank is left waiting for a failed one in a later collective.

`comm` is any object with `rank`, `size`, `all_gather(list of tensors)` (concatenate along dim 0 over the
ranks, uneven first dims allowed) and `reduce_scatter(t, sizes)` (fp32 sum over the ranks, one rounding to
t.dtype, this rank's rows); the harness's `harness.execution.communicator` has a torch.distributed one and a simulated
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


class _RankArgError(ValueError):
    """A per-rank argument check failed; `field` names the argument (sent to the other ranks as a code)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# what the other ranks learn about a rank whose local checks failed: the argument, as an index into this
# tuple (0 = ok; "arguments" = an unexpected error while checking)
_CHECK_FIELDS = ("ok", "hidden_states", "topk_weights", "topk_ids", "config", "lora_ctx", "token_lora_mapping",
                 "arguments")
# the layer signature every rank of the group must share, in the order of the exchanged int64 row (after the
# check status); the LoRA fields are 0 with LoRA off
_SIGNATURE = ("H", "top_k", "dtype", "local_num_experts", "apply_router_weight_on_input", "lora", "max_loras",
              "max_lora_rank", "w13_num_slices")
_LORA_FIELDS = ("max_loras", "max_lora_rank", "w13_num_slices")
_DTYPE_CODES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)   # code = index + 1, 0 = other


def _dtype_code(dt) -> int:
    return _DTYPE_CODES.index(dt) + 1 if dt in _DTYPE_CODES else 0


def _show(field: str, v: int) -> str:
    """A signature value as the message prints it."""
    if field == "dtype":
        return str(_DTYPE_CODES[v - 1]) if 0 < v <= len(_DTYPE_CODES) else "another dtype"
    if field in ("lora", "apply_router_weight_on_input"):
        return {0: "off", 1: "on"}.get(v, str(v))
    return str(v)


def _disagreeing(field: str, values: list[int]) -> str:
    """Which ranks disagree, against the most common value (a tie goes to the lowest rank's value)."""
    counts = {v: values.count(v) for v in values}
    top = max(counts.values())
    ref = next(v for v in values if counts[v] == top)
    bad = [q for q, v in enumerate(values) if v != ref]
    what = (f"the most common value {_show(field, ref)}" if list(counts.values()).count(top) == 1
            else f"rank {values.index(ref)}'s value {_show(field, ref)}")
    return f"rank(s) {bad} disagree with {what}"


class NaiveEPPrepareAndFinalize:
    """All-gather dispatch / reduce-scatter combine over `comm` (a Communicator); see the module doc.

    Rejected at construction (ValueError naming the setting): `fully_sharded=True` (vLLM rejects EP with
    fully-sharded LoRA), a num_experts_global not divisible by the group size, an `all2all_backend` other than
    the all-gather / reduce-scatter one ("naive", "allgather_reducescatter") and `sequence_parallel=True`.
    `expert_map` is this rank's global -> local map to pass to the kernel.
    """

    dispatches = True
    ALL2ALL_BACKENDS = ("naive", "allgather_reducescatter")

    def __init__(self, comm, num_experts_global: int, *, fully_sharded: bool = False, all2all_backend: str = "naive",
                 sequence_parallel: bool = False):
        for attr in ("rank", "size", "all_gather", "reduce_scatter"):
            if not hasattr(comm, attr):
                raise TypeError(f"comm must be a Communicator (rank, size, all_gather, reduce_scatter); "
                                f"{type(comm).__name__} lacks {attr}")
        if fully_sharded:
            raise ValueError("fully_sharded=True: expert parallelism with fully-sharded LoRA is not supported "
                             "(vLLM rejects EP with fully_sharded_loras)")
        if all2all_backend not in self.ALL2ALL_BACKENDS:
            raise ValueError(f"all2all_backend={all2all_backend!r} is not supported: NaiveEPPrepareAndFinalize "
                             f"does the all-gather / reduce-scatter dispatch only; supported: "
                             f"{', '.join(repr(b) for b in self.ALL2ALL_BACKENDS)}")
        if not isinstance(sequence_parallel, bool):
            raise ValueError(f"sequence_parallel must be a bool; got {sequence_parallel!r}")
        if sequence_parallel:
            raise ValueError("sequence_parallel=True: sequence parallelism with expert parallelism is not supported "
                             "(the dispatch gathers each rank's whole token batch, not a sequence shard)")
        self.local_num_experts = _ep_args(comm.size, comm.rank, num_experts_global)
        self.comm = comm
        self.num_experts_global = num_experts_global
        self.all2all_backend = all2all_backend
        self.expert_map = ep_local_expert_map(num_experts_global, comm.size, comm.rank)
        self.tokens_per_rank: list[int] | None = None

    @property
    def ep_rank(self) -> int:
        return self.comm.rank

    @property
    def ep_size(self) -> int:
        return self.comm.size

    def _check(self, hidden_states, topk_weights, topk_ids, config: MoEConfig, lora_ctx) -> int:
        """This rank's own arguments (no collective); raises _RankArgError naming the argument and the rank."""
        r = self.comm.rank
        if not isinstance(config, MoEConfig):
            raise _RankArgError("config", f"config (rank {r}) must be a MoEConfig; got {type(config).__name__}")
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2:
            raise _RankArgError("hidden_states", f"hidden_states (rank {r}) must be a 2-D tensor (T, H={config.H}); "
                                f"got {getattr(hidden_states, 'shape', type(hidden_states).__name__)}")
        T = int(hidden_states.shape[0])
        if int(hidden_states.shape[1]) != config.H:
            raise _RankArgError("hidden_states", f"hidden_states (rank {r}) has hidden size {hidden_states.shape[1]}; "
                                f"expected H={config.H}")
        if hidden_states.dtype != config.dtype:
            raise _RankArgError("hidden_states", f"hidden_states (rank {r}) has dtype {hidden_states.dtype}; "
                                f"expected {config.dtype}")
        for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (T, config.top_k):
                raise _RankArgError(name, f"{name} (rank {r}) must have shape (T={T}, top_k={config.top_k}) like "
                                    f"this rank's hidden states; got {tuple(getattr(t, 'shape', ()))}")
        if topk_ids.dtype != torch.int32:
            raise _RankArgError("topk_ids", f"topk_ids (rank {r}) must be int32; got {topk_ids.dtype}")
        if config.E != self.local_num_experts or not config.expert_map:
            raise _RankArgError("config", f"config (rank {r}) must describe the local layer: E=local_num_experts="
                                f"{self.local_num_experts} and expert_map=True; got E={config.E}, "
                                f"expert_map={config.expert_map}")
        if (lora_ctx is not None) != config.lora_enabled:
            raise _RankArgError("lora_ctx", f"lora_ctx (rank {r}) must be {'given' if config.lora_enabled else 'None'}"
                                f" (config.lora_enabled={config.lora_enabled})")
        if lora_ctx is not None:
            if not isinstance(lora_ctx, MoELoRAContext):
                raise _RankArgError("lora_ctx", f"lora_ctx (rank {r}) must be a MoELoRAContext or None; got "
                                    f"{type(lora_ctx).__name__}")
            if lora_ctx.fully_sharded:
                raise _RankArgError("lora_ctx", f"lora_ctx.fully_sharded (rank {r}): EP with fully-sharded LoRA is "
                                    "not supported")
            if (lora_ctx.local_num_experts, lora_ctx.top_k, lora_ctx.max_lora_rank) != (
                    config.E, config.top_k, config.max_lora_rank):
                raise _RankArgError("lora_ctx", f"lora_ctx (rank {r}) has local_num_experts/top_k/max rank "
                                    f"{lora_ctx.local_num_experts}/{lora_ctx.top_k}/{lora_ctx.max_lora_rank}; the "
                                    f"config says {config.E}/{config.top_k}/{config.max_lora_rank}")
            m = lora_ctx.token_lora_mapping
            if m.shape[0] != T:
                raise _RankArgError("token_lora_mapping", f"token_lora_mapping (rank {r}) has length {m.shape[0]}; "
                                    f"expected this rank's token count T={T}")
        return T

    def _signature(self, config, lora_ctx, status: int) -> list[int]:
        """[status, *_SIGNATURE] for this rank (only what needs no valid argument beyond its type is read)."""
        c = config if isinstance(config, MoEConfig) else None
        ctx = lora_ctx if isinstance(lora_ctx, MoELoRAContext) else None
        sig = dict(H=c.H if c else 0, top_k=c.top_k if c else 0, dtype=_dtype_code(c.dtype) if c else 0,
                   local_num_experts=self.local_num_experts,
                   apply_router_weight_on_input=int(bool(c and c.apply_router_weight_on_input)),
                   lora=int(lora_ctx is not None), max_loras=0, max_lora_rank=0, w13_num_slices=0)
        if ctx is not None:
            sig.update(max_loras=ctx.max_loras, max_lora_rank=ctx.max_lora_rank, w13_num_slices=ctx.w13_num_slices)
        return [status] + [int(sig[f]) for f in _SIGNATURE]

    def check_group(self, hidden_states, topk_weights, topk_ids, config: MoEConfig, lora_ctx=None) -> None:
        """This rank's argument checks, then one all_gather of an int64 row [check status, layer signature].

        Every rank raises ValueError together, so none is left waiting in the dispatch: a rank whose own checks
        failed raises its own error; the others say which rank failed which argument; with all checks passed,
        a signature field (H, top_k, dtype, local experts, router-weight placement, LoRA on/off, max_loras,
        max LoRA rank, w13 slices) that differs between ranks is named with every rank's value.
        """
        r = self.comm.rank
        own: BaseException | None = None
        status = 0
        try:
            self._check(hidden_states, topk_weights, topk_ids, config, lora_ctx)
        except _RankArgError as e:
            own, status = e, _CHECK_FIELDS.index(e.field)
        except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks were told
            own, status = e, _CHECK_FIELDS.index("arguments")
        dev = hidden_states.device if isinstance(hidden_states, torch.Tensor) else torch.device("cpu")
        row = torch.tensor([self._signature(config, lora_ctx, status)], dtype=torch.int64, device=dev)
        try:
            (rows,) = self.comm.all_gather([row])
        except Exception as e:
            if own is not None:    # this rank's own error is the root cause
                raise own from e
            raise
        table = rows.cpu().tolist()
        if own is not None:
            raise own
        failed = [(q, _CHECK_FIELDS[t[0]] if 0 < t[0] < len(_CHECK_FIELDS) else "arguments")
                  for q, t in enumerate(table) if t[0] != 0]
        if failed:
            who = "; ".join(f"rank {q} failed its argument checks: {f}" for q, f in failed)
            raise ValueError(f"EP prepare (rank {r}): {who} (every EP rank raises so that none waits in the "
                             "dispatch; the failing rank's own error names the problem)")
        problems = []
        lora_differs = len({t[1 + _SIGNATURE.index("lora")] for t in table}) > 1
        for i, f in enumerate(_SIGNATURE):
            values = [t[1 + i] for t in table]
            if len(set(values)) == 1 or (lora_differs and f in _LORA_FIELDS):
                continue
            each = ", ".join(f"rank {q}: {_show(f, v)}" for q, v in enumerate(values))
            problems.append(f"{f} differs across EP ranks: {each} ({_disagreeing(f, values)})")
        if problems:
            raise ValueError(f"EP prepare (rank {r}): " + "; ".join(problems)
                             + "; every rank of the group must run the same layer for the gathered batch to mean "
                             "anything")

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
        self.check_group(hidden_states, topk_weights, topk_ids, config, lora_ctx)
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
