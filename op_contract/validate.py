"""vLLM 0.33.0's `fused_moe_lora` signature, written once as `validate_call`, and the checks of its contract.

`validate_call` takes exactly vLLM's arguments and checks what host metadata can tell (types, ranks, shapes,
dtypes, devices, tuning ints); it returns the `OpCall` bundle. The name tuples (ARGS, TUNING_PARAMS, FLAGS) are
read off its signature. It reads no tensor values (no device sync): the id-range check is the kernels' (a sync,
kernels/validate.py), as are our kernels' layout needs (int32 ids, unit strides, collapsible output).
"""
from __future__ import annotations

import inspect

import torch

from moe_lora_harness.op_contract.call import MoELoRAArgumentError, OpCall

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)   # the working dtypes (output, x, LoRA weights)


def validate_call(
    output: torch.Tensor,
    qcurr_hidden_states: torch.Tensor,
    lora_a_stacked: list[torch.Tensor],
    lora_b_stacked: list[torch.Tensor],
    topk_weights: torch.Tensor,
    sorted_token_ids: torch.Tensor | None,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor | None,
    token_lora_mapping: torch.Tensor,
    max_lora_rank: int,
    top_k_num: int,
    lora_ids: torch.Tensor,
    num_active_loras: torch.Tensor,
    adapter_enabled: torch.Tensor,
    shrink_block_size_m: int,
    shrink_block_size_n: int,
    shrink_block_size_k: int,
    shrink_group_size_m: int,
    shrink_num_warps: int,
    shrink_num_stages: int,
    shrink_split_k: int,
    expand_block_size_m: int,
    expand_block_size_n: int,
    expand_block_size_k: int,
    expand_group_size_m: int,
    expand_num_warps: int,
    expand_num_stages: int,
    expand_split_k: int,
    mul_routed_weight: bool = False,
    fully_sharded: bool = False,
    offset: int = 0,
    add_inputs: bool = True,
) -> OpCall:
    """Check one `fused_moe_lora` call (vLLM 0.33.0's parameters, the one spelling of them: every entry point
    shares this signature through `op_contract.entry.vllm_op`) and bundle it as an OpCall.

    Raises TypeError for a wrong type/dtype and MoELoRAArgumentError (a ValueError and an AssertionError) for
    a wrong shape, size, device or tuning value, each naming the argument and what was expected.
    """
    arguments = dict(locals())
    mul_routed_weight = _flag(mul_routed_weight, "mul_routed_weight")
    fully_sharded = _flag(fully_sharded, "fully_sharded")
    add_inputs = _flag(add_inputs, "add_inputs")
    offset = _int(offset, "offset")
    top_k = _int(top_k_num, "top_k_num")
    max_lora_rank = _int(max_lora_rank, "max_lora_rank")
    _check_tuning({n: arguments[n] for n in TUNING_PARAMS})

    _tensor(output, "output (expected (T, k, W))", 3)
    if output.dtype not in FLOAT_DTYPES:
        raise TypeError(f"output must be float16, bfloat16 or float32; got dtype {output.dtype}")
    dt, dev = output.dtype, output.device
    x = _tensor(qcurr_hidden_states, "qcurr_hidden_states (expected (T, K) or (T*k, K))", 2)
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

    A = _stacked(lora_a_stacked, "lora_a_stacked", dt, "(L, E|1, R, K)")
    B = _stacked(lora_b_stacked, "lora_b_stacked", dt, "(L, E|1, N, R)")
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
    block_m = shrink_block_size_m
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


# ------------------------------------------------------------------------ the names, read off the signature

SIGNATURE = inspect.signature(validate_call)
FLAGS = {n: p.default for n, p in SIGNATURE.parameters.items() if p.default is not p.empty}   # name -> default
TUNING_PARAMS = tuple(n for n in SIGNATURE.parameters if n.startswith(("shrink_", "expand_")))   # the 14 ints
ARGS = tuple(n for n in SIGNATURE.parameters if n not in FLAGS and n not in TUNING_PARAMS)   # tensors and sizes
assert tuple(SIGNATURE.parameters) == ARGS + TUNING_PARAMS + tuple(FLAGS), "vLLM's positional order"

_TUNING_BLOCKS = tuple(n for n in TUNING_PARAMS if "_block_size_" in n)   # powers of two
_TUNING_WARPS = tuple(n for n in TUNING_PARAMS if n.endswith("_num_warps"))
_TUNING_POSITIVE = tuple(n for n in TUNING_PARAMS if n not in _TUNING_BLOCKS + _TUNING_WARPS)
# vLLM's default config ints past BLOCK_M (our kernels validate the tuning ints and launch by their own heuristics)
_TUNING_REST = dict(block_size_n=64, block_size_k=32, group_size_m=8, num_warps=4, num_stages=3, split_k=1)


def default_tuning(block_size_m: int) -> dict:
    """The 14 tuning ints (by name, in signature order) the harness, our expert layers and the bench pass:
    BLOCK_M = the align block, the rest vLLM's defaults."""
    return {n: block_size_m if n.endswith("_block_size_m") else _TUNING_REST[n.split("_", 1)[1]]
            for n in TUNING_PARAMS}


# ------------------------------------------------------------------------------------------------ checks

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
    """An integer id tensor (int32 in production; any integer dtype is the same ids)."""
    _tensor(t, f"{arg} (expected {expect} int32)", dims)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{arg} must be an integer tensor {expect} (int32 in production); got dtype {t.dtype}")
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
