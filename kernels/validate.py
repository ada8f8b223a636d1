"""What our kernels need of a `fused_moe_lora` call beyond vLLM's contract (op_contract.validate), before launch.

`check_launchable` checks the layout our kernels index by: int32 ids with a unit-stride last dim, an output
whose (T, k) dims collapse to one pair axis, one stride set shared by every LoRA slice (the reference, an
oracle, takes these as they come: suites/test_bad_input.KERNEL_ONLY). `check_value_ranges` checks id VALUES
(expert ids in [-1, E), LoRA ids in [-1, L]) that our kernels would read out of bounds; that needs one
device->host sync, so it is a single fused check, skipped while a CUDA graph is being captured and when
MOE_LORA_UNCHECKED=1.
"""
from __future__ import annotations

import os

import torch

from moe_lora_harness.op_contract.call import MoELoRAArgumentError, OpCall

UNCHECKED_ENV = "MOE_LORA_UNCHECKED"  # set to 1 to skip the value-range check (it syncs the device)


def check_launchable(call: OpCall) -> None:
    """Raise TypeError (an id tensor not int32) or MoELoRAArgumentError (a stride our kernels cannot index by),
    naming the argument."""
    ids = [("token_lora_mapping", call.token_lora_mapping, "(T,)"), ("adapter_enabled", call.adapter_enabled, "(L+1,)"),
           ("lora_ids", call.lora_ids, "(L+1,)")]
    if call.naive:
        ids.append(("expert_ids", call.expert_ids, "(T*k,) in naive mode"))
    else:
        ids += [("sorted_token_ids", call.sorted_token_ids, "(L, EM)"), ("expert_ids", call.expert_ids, "(L, EM/block)"),
                ("num_tokens_post_padded", call.num_tokens_post_padded, "(L,)")]
    for arg, t, expect in ids:
        if t.dtype != torch.int32:
            raise TypeError(f"{arg} must be int32 {expect}; got dtype {t.dtype}")
        if t.numel() > 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise MoELoRAArgumentError(f"{arg} must be contiguous along its last dim (stride 1); got strides {t.stride()}")
    out, k = call.output, call.top_k
    if call.num_tokens > 1 and out.stride(0) != k * out.stride(1):
        raise MoELoRAArgumentError(
            "output's (T, k) dims must collapse to one pair axis: output.stride(0) must equal "
            f"k * output.stride(1) = {k} * {out.stride(1)}; got strides {out.stride()}"
        )
    for arg, ws in (("lora_a_stacked", call.lora_a), ("lora_b_stacked", call.lora_b)):
        for i, w in enumerate(ws):
            if w.stride() != ws[0].stride():
                raise MoELoRAArgumentError(
                    f"{arg}[{i}] has strides {w.stride()}; the kernels share one stride set across slices, "
                    f"so every slice must have the strides of {arg}[0] {ws[0].stride()}"
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
