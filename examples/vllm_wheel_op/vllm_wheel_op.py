"""vLLM's own `fused_moe_lora` op, loaded from an unpacked vLLM wheel, as a `--backend` (no vLLM install needed).

A user's wrapper, not part of the harness: vLLM's op module imports a dozen vLLM helpers (platform queries, env
flags, a logger, tensor-parallel collectives, a custom-op registrar) and, through its package, every other LoRA
op. This file loads only `vllm/lora/ops/triton_ops/fused_moe_lora_op.py` and its `utils.py`, unchanged, from the
directory `VLLM_SOURCE` names (the folder holding `vllm/`, e.g. `unzip vllm-0.33.0-*.whl 'vllm/*' -d DIR`), and
stands small stand-ins of ours in for the helpers: single-rank collectives (identity), the platform's SM count and
shared memory from torch, vLLM's default env flags. Its kernels, launch heuristics and dispatch are vLLM's own.

    VLLM_SOURCE=DIR moe-lora-harness check --backend examples/vllm_wheel_op/vllm_wheel_op.py:VLLM_OP --only vllm_op

On a CPU set TRITON_INTERPRET=1 (fp16 and fp32 only: the interpreter cannot compute bf16). On a GPU, fp32 runs
its dots in TF32 (Triton's default for fp32 `tl.dot`): the judge fails them unless the backend declares TF32
(`VLLM_OP` does).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moe_lora_harness.harness.spec.source_ops import (init_logger, load_op_module, no_registration, single_rank,
                                                   max_shared_memory_bytes, set_triton_allocator, tensor_h2d)
from moe_lora_harness.op_contract.validate import SIGNATURE

ENV_VAR = "VLLM_SOURCE"
OP_PACKAGE = "vllm.lora.ops.triton_ops"


class _Platform:
    """vLLM's `current_platform`, answered from torch (a CPU default where the interpreter runs)."""

    def is_cuda(self) -> bool:
        return torch.cuda.is_available() and torch.version.hip is None

    def is_cuda_alike(self) -> bool:
        return torch.cuda.is_available()

    def is_rocm(self) -> bool:
        return torch.cuda.is_available() and torch.version.hip is not None

    def is_xpu(self) -> bool:
        return False

    def has_device_capability(self, capability: int, device_id: int = 0) -> bool:
        if not torch.cuda.is_available():
            return False
        major, minor = torch.cuda.get_device_capability(device_id)
        return major * 10 + minor >= capability

    def num_compute_units(self, device_id: int | None = 0) -> int:
        if not torch.cuda.is_available():
            return 132                                   # an H100/H200's SM count: the heuristics' CPU answer
        return torch.cuda.get_device_properties(device_id or 0).multi_processor_count


def _stand_ins() -> dict:
    """vLLM's helper modules the op module and its utils import, as small stand-ins."""
    envs = dict(VLLM_BATCH_INVARIANT=False, VLLM_TUNED_CONFIG_FOLDER=None, VLLM_LORA_DISABLE_PDL=False)
    return {
        "vllm.envs": envs,
        "vllm.logger": {"init_logger": init_logger},
        "vllm.platforms": {"current_platform": _Platform(), "vllm_version_matches_substr": lambda s: False},
        "vllm.distributed": {"tensor_model_parallel_all_gather": single_rank,
                             "tensor_model_parallel_all_reduce": single_rank},
        "vllm.triton_utils": {"tl": tl, "triton": triton, "HAS_TRITON": True},
        "vllm.triton_utils.allocation": {"set_triton_allocator": set_triton_allocator},
        "vllm.utils.mem_utils": {"get_max_shared_memory_bytes": max_shared_memory_bytes},
        "vllm.utils.torch_utils": {"async_tensor_h2d": tensor_h2d,
                                   "direct_register_custom_op": no_registration},
        "vllm.utils.math_utils": {"next_power_of_2": lambda n: 1 << max(int(n) - 1, 0).bit_length(),
                                  "cdiv": lambda a, b: -(a // -b)},
    }


@functools.cache
def _op_module():
    try:     # vLLM's triton_utils imports it (the op's TMA path reads triton.tools.tensor_descriptor)
        import triton.tools.tensor_descriptor  # noqa: F401
    except ImportError:
        pass
    return load_op_module(ENV_VAR, OP_PACKAGE, "fused_moe_lora_op", _stand_ins())


def fused_moe_lora(*args, **kwargs):
    """vLLM 0.33.0's `_fused_moe_lora` (the function its custom op registers), called as the harness calls an op."""
    return _op_module()._fused_moe_lora(*args, **kwargs)


fused_moe_lora.__signature__ = SIGNATURE      # vLLM's parameters, which the registry reads (and vLLM's function has)


# --- the same op declared as a user who has read vLLM's source would (imports of the harness's public contract) --
from moe_lora_harness.harness.spec.contract import BackendSpec, Capabilities, KnownBug  # noqa: E402
from moe_lora_harness.harness.spec.registry import vllm_dispatch_precision  # noqa: E402


def _path(case) -> str:
    return vllm_dispatch_precision(case)


def _cuda_precision(case) -> str:
    """On a GPU, fp32 `tl.dot` is TF32 with its operands' low bits dropped (Triton's default, no input_precision)."""
    return f"{_path(case)}_tf32rz" if case.dtype == "float32" else _path(case)


OFFSET_IGNORED = KnownBug(
    issue="vLLM 0.33.0 fused_moe_lora_op.py: _run_fused_moe_lora_one_shot and _run_fused_moe_lora_small_batch "
          "take no offset",
    description="the one-shot and small-batch paths write slice s at columns [s*N, (s+1)*N) whatever `offset` "
                "says (only the two-kernel path, the fully-sharded one, honours it)",
    applies=lambda case: case.offset != 0 and _path(case) in ("one_shot", "small_batch"),
    shows=lambda case, before, written: bool(written.any()))   # nothing written: nothing misplaced

VLLM_OP = BackendSpec(
    name="vllm_op",
    description="vLLM 0.33.0's fused_moe_lora from its wheel (examples/vllm_wheel_op); fp32 on a GPU is TF32",
    capabilities=Capabilities(levels=frozenset({"op"})),
    op=fused_moe_lora,
    precision={"cpu": vllm_dispatch_precision, "cuda": _cuda_precision},
    # vLLM's kernels are where the rounding model comes from: they round where it does, and the CPU's interpreter
    # sums each tl.dot in fp32 (rules 3 and 4 then allow flips alone: docs/error-model.md). Not yet declared on CUDA,
    # where it has not been measured with the declaration in place
    model_points_only={"cpu": True},
    known_bugs=(OFFSET_IGNORED,))
