"""Public entry points of our Triton MoE-LoRA op, with vLLM 0.33.0's `fused_moe_lora` signature (op_contract).

`fused_moe_lora` validates (vLLM's contract, op_contract.validate; then our kernels' layout needs and id
ranges, one sync: kernels/validate.py, MOE_LORA_UNCHECKED) and dispatches like vLLM (spec 1.3): small-batch
for a naive layout with rank <= 64 and T*k*rank <= 1024, else one-shot for rank <= 128 when not fully
sharded, else two-kernel (any rank, fully_sharded collectives). `fused_moe_lora_{one_shot,small_batch,
two_kernel}` force a path. An argument error (a call a path cannot take included) raises
MoELoRAArgumentError, a ValueError and an AssertionError (vLLM asserts), naming the condition; a wrong type
raises TypeError. vLLM's tuning ints are validated, not honoured, except shrink_block_size_m, which must be
the align block size in sorted mode.
"""
from __future__ import annotations

from typing import Callable

import torch

from moe_lora_harness.kernels.validate import check_launchable, check_value_ranges
from moe_lora_harness.kernels.triton.one_shot import OneShotConfig, one_shot_unsupported, run_one_shot
from moe_lora_harness.kernels.triton.small_batch import run_small_batch, small_batch_unsupported
from moe_lora_harness.kernels.triton.two_kernel import run_two_kernel
from moe_lora_harness.op_contract.call import MoELoRAArgumentError, OpCall
from moe_lora_harness.op_contract.entry import vllm_op

PATHS = ("one_shot", "small_batch", "two_kernel")


def select_path(*, naive: bool, max_lora_rank: int, num_pairs: int, fully_sharded: bool = False) -> str:
    """The path `fused_moe_lora` takes for a call (naive = sorted_token_ids is None, num_pairs = T*k): the
    first of small-batch and one-shot that can take it (each path's module says), else two-kernel (any call)."""
    if small_batch_unsupported(naive, max_lora_rank, num_pairs, fully_sharded) is None:
        return "small_batch"
    if one_shot_unsupported(max_lora_rank, fully_sharded) is None:
        return "one_shot"
    return "two_kernel"


def _run(path: str, call: OpCall, collective: Callable | None, one_shot_config=None) -> None:
    check_launchable(call)
    if path == "small_batch":
        why = small_batch_unsupported(call.naive, call.rank, call.num_pairs, call.fully_sharded)
    elif path == "one_shot":
        why = one_shot_unsupported(call.rank, call.fully_sharded)
    else:
        why = None
    if why:
        raise MoELoRAArgumentError(why)
    if collective is not None and not callable(collective):
        raise TypeError(f"collective must be a callable cache -> cache or None; got {type(collective).__name__}")
    check_value_ranges(call)
    dev = call.output.device
    if dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device():
        with torch.cuda.device(dev):  # Triton launches on the current device
            _launch(path, call, collective, one_shot_config)
    else:
        _launch(path, call, collective, one_shot_config)


def _launch(path: str, call: OpCall, collective: Callable | None, one_shot_config=None) -> None:
    if path == "small_batch":
        run_small_batch(call)
    elif path == "one_shot":
        cfg = one_shot_config(call) if callable(one_shot_config) else one_shot_config
        if cfg is not None and not isinstance(cfg, OneShotConfig):
            raise TypeError(f"config must be a OneShotConfig or a callable OpCall -> OneShotConfig; got "
                            f"{type(cfg).__name__}")
        run_one_shot(call, cfg)
    else:
        run_two_kernel(call, collective)


@vllm_op
def fused_moe_lora(call: OpCall, *, collective=None) -> None:
    """Add the MoE-LoRA delta into `output` in place (vLLM 0.33.0 contract), dispatching like spec 1.3.

    `collective` (keyword-only, fully_sharded only): a callable taking the (S, T, k, R_local) rank cache
    and returning the joined cache; default torch.distributed's group, or identity on one rank.
    """
    path = select_path(naive=call.naive, max_lora_rank=call.rank, num_pairs=call.num_pairs,
                       fully_sharded=call.fully_sharded)
    _run(path, call, collective)


@vllm_op
def fused_moe_lora_one_shot(call: OpCall, *, config=None) -> None:
    """`fused_moe_lora` forced onto the one-shot kernel (rank <= 128, not fully_sharded; else MoELoRAArgumentError).

    `config` (keyword-only): a OneShotConfig, or a callable OpCall -> OneShotConfig, replacing the launch
    heuristic (tests and sweeps use it to force split-K, N splits, tiles)."""
    _run("one_shot", call, None, config)


@vllm_op
def fused_moe_lora_small_batch(call: OpCall) -> None:
    """`fused_moe_lora` forced onto the small-batch kernel (naive, rank <= 64, T*k*rank <= 1024; else
    MoELoRAArgumentError)."""
    _run("small_batch", call, None)


@vllm_op
def fused_moe_lora_two_kernel(call: OpCall, *, collective=None) -> None:
    """`fused_moe_lora` forced onto the two-kernel path (any rank; fully_sharded with `collective` as above)."""
    _run("two_kernel", call, collective)


ENTRY_POINTS = {
    "one_shot": fused_moe_lora_one_shot,
    "small_batch": fused_moe_lora_small_batch,
    "two_kernel": fused_moe_lora_two_kernel,
}
