"""SGLang's own MoE-LoRA op (`sglang.kernels.ops.lora.moe.fused_moe_lora_kernel`), loaded from an unpacked SGLang
wheel, as a `--backend` (no SGLang install needed).

A user's wrapper, not part of the harness. SGLang's op (0.5.23: adapted from vLLM's two-kernel path) takes vLLM's
arguments less three: no token_lora_mapping and no num_active_loras (the sorted layout already says which tokens
each slot has, and its lora_ids lists slots for max_loras programs: `_sglang_lora_ids` converts vLLM's), no add_inputs (it always adds its delta into the output, `output += delta`, in PyTorch after the
kernels). So it is declared for the sorted layout with add_inputs=True only, and judged at the two-kernel path's
rounding points (the rank intermediate and the delta rounded to the dtype, then the add). Its module is loaded
unchanged from `SGLANG_SOURCE` (the folder holding `sglang/`, e.g. `unzip sglang-*.whl
'sglang/kernels/ops/lora/moe/fused_moe_lora_kernel.py' -d DIR`); small stand-ins of ours replace the two SGLang
helpers it imports (single-rank collectives; the SM90 / Blackwell queries, from torch).

    SGLANG_SOURCE=DIR moe-lora-harness check --backend examples/sglang_wheel_op/sglang_wheel_op.py:SGLANG_OP \
        --only sglang_op

On a CPU set TRITON_INTERPRET=1 (fp16 and fp32 only: the interpreter cannot compute bf16).
"""
from __future__ import annotations

import functools

import torch

from moe_lora_harness.harness.spec.contract import BackendSpec, Capabilities, KnownBug, Rule
from moe_lora_harness.harness.spec.source_ops import load_op_module, no_registration, single_rank
from moe_lora_harness.op_contract.validate import SIGNATURE

ENV_VAR = "SGLANG_SOURCE"
OP_PACKAGE = "sglang.kernels.ops.lora.moe"


def _capability_at_least(major: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= major


@functools.cache
def _op_module():
    """SGLang's op module from its source, with the two SGLang helper modules it imports as stand-ins."""
    return load_op_module(ENV_VAR, OP_PACKAGE, "fused_moe_lora_kernel", {
        "sglang.srt.distributed": {"tensor_model_parallel_all_gather": single_rank,
                                   "tensor_model_parallel_all_reduce": single_rank},
        "sglang.srt.utils.common": {"is_sm90_supported": lambda: _capability_at_least(9),
                                    "is_blackwell_supported": lambda: _capability_at_least(10),
                                    "direct_register_custom_op": no_registration}})


def fused_moe_lora(*args, **kwargs):
    """vLLM's fused_moe_lora call as SGLang's `_fused_moe_lora` takes it (token_lora_mapping, num_active_loras and
    add_inputs have no SGLang argument: the declaration keeps the cases that need them away)."""
    op = _op_module()._fused_moe_lora
    a = SIGNATURE.bind(*args, **kwargs)
    a.apply_defaults()
    kw = dict(a.arguments)
    if kw["sorted_token_ids"] is None or not kw.pop("add_inputs"):
        raise ValueError("sglang_op: SGLang's fused_moe_lora takes the sorted layout (sorted_token_ids) and always "
                         "adds its delta (add_inputs=True)")
    kw["lora_ids"] = _sglang_lora_ids(kw["lora_ids"], kw.pop("num_active_loras"), kw["lora_a_stacked"][0].shape[0])
    del kw["token_lora_mapping"]
    return op(**kw)


fused_moe_lora.__signature__ = SIGNATURE      # vLLM's parameters, which the registry reads


def _sglang_lora_ids(lora_ids, num_active_loras, max_loras: int):
    """vLLM's slot list as SGLang's kernels read it. vLLM processes lora_ids[i] for i < num_active_loras (its L + 1
    entries may begin with -1, for tokens without an adapter); SGLang launches max_loras programs, program i taking
    lora_ids[i] and skipping -1 (its own caller passes arange(max_loras)). So the listed slots go first, -1 after:
    the same slots processed, none cut off by the shorter grid."""
    active = lora_ids[: int(num_active_loras)].long()
    active = active[(active >= 0) & (active < max_loras)]
    if active.numel() > max_loras:
        raise ValueError(f"sglang_op: lora_ids lists {active.numel()} slots for {max_loras} programs (a slot twice)")
    ids = torch.full((max_loras,), -1, dtype=lora_ids.dtype, device=lora_ids.device)
    ids[: active.numel()] = active.to(lora_ids.dtype)
    return ids


def _untouched_negative_zero(case, before, written) -> bool:
    """Whether the buffer holds -0.0 where the contract leaves it untouched but SGLang's closing add covers (every
    pair's columns from `offset` on)."""
    cols = torch.arange(before.shape[-1], device=before.device)
    return bool((~written & (cols >= case.offset) & (before == 0) & torch.signbit(before)).any())


ZERO_SIGN = KnownBug(
    issue="SGLang 0.5.23 fused_moe_lora_kernel.py: _fused_moe_lora_expand ends with output[...] += b_intermediate",
    description="the delta is added to every pair in PyTorch, zero where no adapter applies: an untouched -0.0 "
                "becomes +0.0 (values equal, bits not; the contract leaves those elements as they were)",
    applies=lambda case: True, shows=_untouched_negative_zero)

SGLANG_OP = BackendSpec(
    name="sglang_op",
    description="SGLang 0.5.23's fused_moe_lora from its wheel (examples/sglang_wheel_op): two kernels, then "
                "output += delta; fp32 on a GPU is TF32",
    capabilities=Capabilities(
        levels=frozenset({"op"}), layouts=frozenset({"sorted"}),
        reasons={("layout", "naive"): "SGLang's op takes sorted_token_ids always (no naive block assignment)"},
        rules=(Rule("add_inputs", lambda case: case.add_inputs,
                    "SGLang's op always adds its delta into the output (output += delta): add_inputs=False has "
                    "no SGLang argument"),)),
    op=fused_moe_lora,
    precision={"cpu": "two_kernel", "cuda": lambda case: "two_kernel_tf32rz" if case.dtype == "float32"
               else "two_kernel"},
    known_bugs=(ZERO_SIGN,))
