"""Argument validation for the MoE-LoRA op, run before any kernel launch.

`validate_call` checks what host metadata can tell (types, ranks, shapes, dtypes, devices, strides,
tuning ints) and returns an `OpCall` bundle the launchers read. `check_value_ranges` checks id
VALUES (expert ids in [-1, E), LoRA ids in [-1, L]); that needs one device->host sync, so it is a
single fused check, skipped while a CUDA graph is being captured and when MOE_LORA_UNCHECKED=1.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from moe_lora_harness.kernels.dtypes import FLOAT_DTYPES

UNCHECKED_ENV = "MOE_LORA_UNCHECKED"  # set to 1 to skip the value-range check (it syncs the device)

# vLLM 0.33.0's tuning ints of fused_moe_lora, in signature order (after adapter_enabled).
TUNING_PARAMS = (
    "shrink_block_size_m", "shrink_block_size_n", "shrink_block_size_k", "shrink_group_size_m",
    "shrink_num_warps", "shrink_num_stages", "shrink_split_k", "expand_block_size_m", "expand_block_size_n",
    "expand_block_size_k", "expand_group_size_m", "expand_num_warps", "expand_num_stages", "expand_split_k",
)
_TUNING_BLOCKS = tuple(n for n in TUNING_PARAMS if "_block_size_" in n)   # powers of two
_TUNING_WARPS = tuple(n for n in TUNING_PARAMS if n.endswith("_num_warps"))
_TUNING_POSITIVE = tuple(n for n in TUNING_PARAMS if n not in _TUNING_BLOCKS + _TUNING_WARPS)


class MoELoRAArgumentError(ValueError, AssertionError):
    """An argument the MoE-LoRA op cannot take: a shape, size, stride, device, layout, id range or path condition.

    A ValueError, as Python reports a bad argument value; and an AssertionError too, because vLLM 0.33.0's
    fused_moe_lora checks the same conditions with `assert`, and its callers and tests expect that (vLLM's
    test wants an AssertionError naming shrink_block_size_m when the sorted layout gets a BLOCK_M that is
    not a power of two >= 16). As a drop-in, our op's argument errors satisfy `except ValueError` and
    `except AssertionError` alike. Wrong types and dtypes stay TypeError.
    """


@dataclass
class OpCall:
    """The validated tensors of one `fused_moe_lora` call and the sizes the launchers need."""

    output: torch.Tensor  # (T, k, W), (T, k) collapsible to the flat pair axis p = t*k + j
    x: torch.Tensor  # (T, K) or (T*k, K)
    lora_a: list  # S x (L, E|1, R, K), identical shapes and strides
    lora_b: list  # S x (L, E|1, N, R'), identical shapes and strides
    weights: torch.Tensor  # (T*k,) routing weights, flat over pairs
    sorted_token_ids: torch.Tensor | None  # (L, EM) int32 or None (naive)
    expert_ids: torch.Tensor  # (L, EM/BM) int32 sorted, (T*k,) naive
    num_tokens_post_padded: torch.Tensor | None  # (L,) int32
    token_lora_mapping: torch.Tensor  # (T,) int32
    lora_ids: torch.Tensor  # (>= num_active,) int32
    adapter_enabled: torch.Tensor  # (>= L,) int32
    num_tokens: int
    top_k: int
    num_slices: int
    max_loras: int
    experts_a: int
    experts_b: int
    rank: int  # A's rank rows (= max_lora_rank)
    rank_b: int  # B's rank columns (= rank, or the gathered rank under fully_sharded w13)
    hidden: int  # K
    n_out: int  # N per slice
    offset: int
    block_m: int  # align block size (shrink_block_size_m)
    num_active: int  # sorted-mode grid size over lora_ids
    mul_routed_weight: bool
    add_inputs: bool
    fully_sharded: bool

    @property
    def num_pairs(self) -> int:
        """T * k, the flat pair count (also the pad value of sorted_token_ids)."""
        return self.num_tokens * self.top_k

    @property
    def naive(self) -> bool:
        """True for naive block assignment (sorted_token_ids is None)."""
        return self.sorted_token_ids is None

    @property
    def em(self) -> int:
        """Padded length of one LoRA's sorted ids (0 in naive mode)."""
        return 0 if self.sorted_token_ids is None else int(self.sorted_token_ids.shape[1])

    @property
    def num_experts(self) -> int:
        """Local expert count implied by the weights (1 when every factor is shared)."""
        return max(self.experts_a, self.experts_b)

    @property
    def x_row_div(self) -> int:
        """x row of pair p is p // x_row_div: 1 with mul_routed_weight (x is (T*k, K)), else k."""
        return 1 if self.mul_routed_weight else self.top_k


def _describe(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor of shape {tuple(v.shape)}, dtype {v.dtype}, device {v.device}"
    return f"{type(v).__name__} {v!r}"[:120]


def _int(v, arg: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{arg} must be a Python int; got {_describe(v)}")
    return v


def _flag(v, arg: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise TypeError(f"{arg} must be a bool; got {_describe(v)}")


def _tensor(t, arg: str, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor; got {_describe(t)}")
    if t.dim() != dims:
        raise MoELoRAArgumentError(f"{arg} must be {dims}-D; got shape {tuple(t.shape)}")
    return t


def _ids(t, arg: str, dims: int, expect: str) -> torch.Tensor:
    """An int32 id tensor whose last dim is unit-stride (the kernels index it as a flat row)."""
    _tensor(t, f"{arg} (expected {expect} int32)", dims)
    if t.dtype != torch.int32:
        raise TypeError(f"{arg} must be int32 {expect}; got dtype {t.dtype}")
    if t.numel() > 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise MoELoRAArgumentError(f"{arg} must be contiguous along its last dim (stride 1); got strides {t.stride()}")
    return t


def _stacked(ws, arg: str, dtype: torch.dtype, expect: str) -> list:
    if not isinstance(ws, (list, tuple)):
        raise TypeError(f"{arg} must be a list of S tensors {expect}; got {_describe(ws)}")
    if len(ws) == 0:
        raise MoELoRAArgumentError(f"{arg} must hold at least one slice tensor {expect}; got an empty list")
    for i, w in enumerate(ws):
        _tensor(w, f"{arg}[{i}] (expected {expect})", 4)
        if w.dtype != dtype:
            raise TypeError(
                f"{arg}[{i}] has dtype {w.dtype}; LoRA weights must have the output's dtype {dtype}"
            )
        if w.shape != ws[0].shape:
            raise MoELoRAArgumentError(f"{arg}[{i}] has shape {tuple(w.shape)}; every slice must match {tuple(ws[0].shape)}")
        if w.stride() != ws[0].stride():
            raise MoELoRAArgumentError(
                f"{arg}[{i}] has strides {w.stride()}; the kernels share one stride set across slices, "
                f"so every slice must have the strides of {arg}[0] {ws[0].stride()}"
            )
    return list(ws)


def _check_tuning(tuning: dict) -> None:
    for name in _TUNING_BLOCKS:
        v = _int(tuning[name], name)
        if v <= 0 or v & (v - 1):
            raise MoELoRAArgumentError(f"{name} must be a positive power of two; got {v}")
    for name in _TUNING_WARPS:
        v = _int(tuning[name], name)
        if v not in (1, 2, 4, 8, 16, 32):
            raise MoELoRAArgumentError(f"{name} must be a power of two in [1, 32]; got {v}")
    for name in _TUNING_POSITIVE:
        if _int(tuning[name], name) <= 0:
            raise MoELoRAArgumentError(f"{name} must be a positive int; got {tuning[name]}")


def _num_active(num_active_loras, n_ids: int) -> int:
    if isinstance(num_active_loras, torch.Tensor):
        if num_active_loras.numel() != 1 or num_active_loras.is_floating_point():
            raise MoELoRAArgumentError(
                "num_active_loras must be a one-element integer CPU tensor (or an int); "
                f"got {_describe(num_active_loras)}"
            )
        if num_active_loras.device.type != "cpu":
            raise MoELoRAArgumentError(
                "num_active_loras must live on the CPU (it sizes the launch grid; a device tensor would "
                f"need a sync); got device {num_active_loras.device}"
            )
        n = int(num_active_loras.reshape(-1)[0])
    else:
        n = _int(num_active_loras, "num_active_loras")
    if not 0 <= n <= n_ids:
        raise MoELoRAArgumentError(f"num_active_loras must be in [0, lora_ids.numel()={n_ids}]; got {n}")
    return n


def validate_call(
    output, x, lora_a, lora_b, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
    token_lora_mapping, max_lora_rank, top_k_num, lora_ids, num_active_loras, adapter_enabled,
    tuning: dict, mul_routed_weight, fully_sharded, offset, add_inputs,
) -> OpCall:
    """Check every argument of `fused_moe_lora` (vLLM 0.33.0 signature) and bundle them as an OpCall.

    Raises TypeError for a wrong type/dtype and MoELoRAArgumentError (a ValueError and an AssertionError) for
    a wrong shape, device, stride or range, each naming the argument and what was expected. Reads no tensor values (no device sync).
    """
    mul_routed_weight = _flag(mul_routed_weight, "mul_routed_weight")
    fully_sharded = _flag(fully_sharded, "fully_sharded")
    add_inputs = _flag(add_inputs, "add_inputs")
    offset = _int(offset, "offset")
    top_k = _int(top_k_num, "top_k_num")
    max_lora_rank = _int(max_lora_rank, "max_lora_rank")
    _check_tuning(tuning)

    _tensor(output, "output (expected (T, k, W))", 3)
    if output.dtype not in FLOAT_DTYPES:
        raise TypeError(f"output must be float16, bfloat16 or float32; got dtype {output.dtype}")
    dt, dev = output.dtype, output.device
    _tensor(x, "qcurr_hidden_states (expected (T, K) or (T*k, K))", 2)
    if x.dtype != dt:
        raise TypeError(f"qcurr_hidden_states must have the output's dtype {dt}; got {x.dtype}")
    _tensor(topk_weights, "topk_weights (expected (T, k) float)", 2)
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be a floating-point tensor (promoted to fp32); got {topk_weights.dtype}")
    T, k = (int(s) for s in topk_weights.shape)
    if top_k < 1 or top_k != k:
        raise MoELoRAArgumentError(f"top_k_num must equal topk_weights.shape[1]={k} (>= 1); got {top_k}")
    if tuple(output.shape[:2]) != (T, k):
        raise MoELoRAArgumentError(f"output must have shape (T, k, W) = ({T}, {k}, W) like topk_weights; got {tuple(output.shape)}")
    if T > 1 and output.stride(0) != k * output.stride(1):
        raise MoELoRAArgumentError(
            "output's (T, k) dims must collapse to one pair axis: output.stride(0) must equal "
            f"k * output.stride(1) = {k} * {output.stride(1)}; got strides {output.stride()}"
        )

    A = _stacked(lora_a, "lora_a_stacked", dt, "(L, E|1, R, K)")
    B = _stacked(lora_b, "lora_b_stacked", dt, "(L, E|1, N, R)")
    if len(A) != len(B):
        raise MoELoRAArgumentError(f"lora_a_stacked and lora_b_stacked must have the same length S; got {len(A)} and {len(B)}")
    S = len(A)
    L, Ea, R, K = (int(s) for s in A[0].shape)
    Lb, Eb, N, Rb = (int(s) for s in B[0].shape)
    if min(L, Ea, R, K) < 1 or min(Eb, N, Rb) < 1:
        raise MoELoRAArgumentError(f"LoRA weights must have non-empty dims; got A {tuple(A[0].shape)}, B {tuple(B[0].shape)}")
    if Lb != L:
        raise MoELoRAArgumentError(f"lora_b_stacked[0].shape[0] must equal max_loras L={L} (from lora_a_stacked); got {Lb}")
    if Ea > 1 and Eb > 1 and Ea != Eb:
        raise MoELoRAArgumentError(f"LoRA expert dims must be equal or 1 (shared); got lora_a E={Ea}, lora_b E={Eb}")
    if max_lora_rank != R:
        raise MoELoRAArgumentError(f"max_lora_rank must equal lora_a_stacked[0].shape[2]={R}; got {max_lora_rank}")
    if fully_sharded:
        if not add_inputs:
            raise MoELoRAArgumentError("add_inputs must be True when fully_sharded=True (as vLLM 0.33.0 asserts)")
        if Rb % R:
            raise MoELoRAArgumentError(
                f"fully_sharded: lora_b_stacked rank dim ({Rb}) must be R (w2, all_reduce) or a multiple "
                f"of the local rank R={R} (w13, all_gather)"
            )
    elif Rb != R:
        raise MoELoRAArgumentError(f"lora_b_stacked[0].shape[3] must equal the rank R={R}; got {Rb}")
    rows = T * k if mul_routed_weight else T
    if tuple(x.shape) != (rows, K):
        what = "(T*k, K) with mul_routed_weight=True" if mul_routed_weight else "(T, K) with mul_routed_weight=False"
        raise MoELoRAArgumentError(f"qcurr_hidden_states must have shape {what} = {(rows, K)}; got {tuple(x.shape)}")
    if offset < 0 or output.shape[2] < offset + S * N:
        raise MoELoRAArgumentError(
            f"output.shape[2] must be >= offset + S*N = {offset} + {S}*{N} = {offset + S * N} (offset >= 0); "
            f"got W={output.shape[2]}, offset={offset}"
        )

    mapping = _ids(token_lora_mapping, "token_lora_mapping", 1, "(T,)")
    if mapping.shape[0] != T:
        raise MoELoRAArgumentError(f"token_lora_mapping must have shape (T,)=({T},); got {tuple(mapping.shape)}")
    enabled = _ids(adapter_enabled, "adapter_enabled", 1, "(L+1,)")
    if enabled.shape[0] < L:
        raise MoELoRAArgumentError(f"adapter_enabled must have shape (L+1,)=({L + 1},) (at least L entries); got {tuple(enabled.shape)}")
    ids = _ids(lora_ids, "lora_ids", 1, "(L+1,)")
    block_m = _int(tuning["shrink_block_size_m"], "shrink_block_size_m")
    if sorted_token_ids is None:
        if num_tokens_post_padded is not None:
            raise MoELoRAArgumentError("num_tokens_post_padded must be None when sorted_token_ids is None (naive mode)")
        eids = _ids(expert_ids, "expert_ids", 1, "(T*k,) in naive mode")
        if eids.shape[0] != T * k:
            raise MoELoRAArgumentError(f"expert_ids must have shape (T*k,)=({T * k},) in naive mode; got {tuple(eids.shape)}")
        n_active = 1
    else:
        if num_tokens_post_padded is None:
            raise MoELoRAArgumentError("num_tokens_post_padded (shape (L,)) must be given with sorted_token_ids")
        sids = _ids(sorted_token_ids, "sorted_token_ids", 2, "(L, EM)")
        if block_m < 16 or block_m & (block_m - 1):
            raise MoELoRAArgumentError(
                f"shrink_block_size_m must be a power of two >= 16 and equal the align block size; got {block_m}"
            )
        em = int(sids.shape[1])
        mb = -(-em // block_m)
        eids = _ids(expert_ids, "expert_ids", 2, "(L, EM/block)")
        if sids.shape[0] != L or tuple(eids.shape) != (L, mb):
            raise MoELoRAArgumentError(
                f"sorted mode needs sorted_token_ids (L, EM) and expert_ids (L, cdiv(EM, shrink_block_size_m)) = "
                f"({L}, {em}) and ({L}, {mb}); got {tuple(sids.shape)} and {tuple(eids.shape)} "
                "(is shrink_block_size_m the align block size?)"
            )
        ntpp = _ids(num_tokens_post_padded, "num_tokens_post_padded", 1, "(L,)")
        if ntpp.shape[0] != L:
            raise MoELoRAArgumentError(f"num_tokens_post_padded must have shape (L,)=({L},); got {tuple(ntpp.shape)}")
        n_active = _num_active(num_active_loras, ids.shape[0])

    named = [("qcurr_hidden_states", x), ("topk_weights", topk_weights), ("expert_ids", expert_ids),
             ("token_lora_mapping", mapping), ("lora_ids", ids), ("adapter_enabled", enabled)]
    named += [(f"lora_a_stacked[{i}]", a) for i, a in enumerate(A)] + [(f"lora_b_stacked[{i}]", b) for i, b in enumerate(B)]
    if sorted_token_ids is not None:
        named += [("sorted_token_ids", sorted_token_ids), ("num_tokens_post_padded", num_tokens_post_padded)]
    for arg, t in named:
        if t.device != dev:
            raise MoELoRAArgumentError(f"{arg} is on {t.device}; every tensor must be on the output's device {dev}")

    return OpCall(
        output=output, x=x, lora_a=A, lora_b=B, weights=topk_weights.reshape(-1),
        sorted_token_ids=sorted_token_ids, expert_ids=expert_ids, num_tokens_post_padded=num_tokens_post_padded,
        token_lora_mapping=mapping, lora_ids=ids, adapter_enabled=enabled, num_tokens=T, top_k=k,
        num_slices=S, max_loras=L, experts_a=Ea, experts_b=Eb, rank=R, rank_b=Rb, hidden=K, n_out=N,
        offset=offset, block_m=block_m, num_active=n_active, mul_routed_weight=mul_routed_weight,
        add_inputs=add_inputs, fully_sharded=fully_sharded,
    )


def checks_enabled(device: torch.device) -> bool:
    """Whether the value-range check runs: not with MOE_LORA_UNCHECKED=1, not during CUDA-graph capture."""
    if os.environ.get(UNCHECKED_ENV, "0") not in ("", "0"):
        return False
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return True


def check_value_ranges(call: OpCall) -> None:
    """One fused device check (a single sync) that the ids the kernels will read are in range.

    Checked: token_lora_mapping in [-1, L]; naive expert_ids in [-1, E); sorted mode: lora_ids[:num_active]
    in [-1, L] and expert_ids in [-1, E) in the blocks the kernels read (rows of active, enabled
    LoRAs, blocks below num_tokens_post_padded). E = 1 (all factors shared) bounds nothing above.
    """
    if call.num_tokens == 0 or not checks_enabled(call.output.device):
        return
    L, E = call.max_loras, call.num_experts
    dev = call.output.device

    def out_of(t: torch.Tensor, hi: int | None) -> torch.Tensor:
        bad = t < -1
        return bad | (t > hi) if hi is not None else bad

    e_hi = E - 1 if E > 1 else None
    flags = [out_of(call.token_lora_mapping, L).any()]
    names = [f"token_lora_mapping must hold LoRA slots in [-1, {L}]"]
    if call.naive:
        flags.append(out_of(call.expert_ids, e_hi).any())
        names.append(f"expert_ids must hold expert ids in [-1, {E})")
    elif call.num_active > 0:
        act = call.lora_ids[: call.num_active].long()
        flags.append(out_of(act, L).any())
        names.append(f"lora_ids[:num_active_loras] must hold LoRA slots in [-1, {L}]")
        ok = (act >= 0) & (act < L)
        row = torch.zeros(L + 1, dtype=torch.bool, device=dev).index_fill_(0, torch.where(ok, act, L), True)[:L]
        row &= call.adapter_enabled[:L] != 0
        mb = call.expert_ids.shape[1]
        starts = torch.arange(mb, device=dev, dtype=torch.int64) * call.block_m
        live = row[:, None] & (starts[None, :] < call.num_tokens_post_padded.long()[:, None])
        flags.append((live & out_of(call.expert_ids, e_hi)).any())
        names.append(f"expert_ids must hold local expert ids in [-1, {E}) in the blocks of active LoRAs")
    bad = torch.stack(flags).tolist()
    failed = [n for n, b in zip(names, bad) if b]
    if failed:
        raise MoELoRAArgumentError(
            "; ".join(failed) + f" (set {UNCHECKED_ENV}=1 to skip this check)"
        )
