"""vLLM 0.33.0's own expert class, `TritonExperts` with its `LoRAExpertsMixin`, loaded from an unpacked vLLM wheel as
an expert-level `--backend` (no vLLM install needed).

A user's wrapper, not part of the harness. vLLM's Python files run unchanged from the directory `VLLM_SOURCE` names
(the folder holding `vllm/`): the expert class (`experts/triton_moe.py`, `lora_experts_mixin.py`, `lora_context.py`),
the modular-kernel base classes and configs (`modular_kernel.py`, `config.py`, `activation.py`, `utils.py`,
`moe_align_block_size.py`, `moe_output.py`, `topk_weight_and_reduce.py`), the fused-MoE Triton GEMM with its launch
and config heuristics (`fused_moe.py` and the tuned `configs/*.json`), the punica wrapper
(`punica_gpu.py`, `punica_base.py`, `punica_wrapper/utils.py`: `update_metadata`, `add_lora_w13`, `add_lora_w2`),
the LoRA op (`fused_moe_lora_op.py`, `utils.py`, `lora_kernel_metadata.py`), `lora/layers/utils.py` (LoRAMapping, the
LoRA tile heuristics), the quant keys (`quant_utils.py`, `scalar_type.py`) and `layers/activation.py` (swiglustep's
Triton kernel).

Stood in by our own small code (vLLM's packages' `__init__` files never run): the compiled ops that cannot load
without vLLM's binary (`vllm._custom_ops.moe_align_block_size`, `moe_lora_align_block_size`, `moe_sum`, the
`torch.ops._C` activation kernels), with vLLM's CUDA rounding points; env flags at vLLM's defaults; a logger; the
platform answered from torch; single-rank collectives; vLLM's engine-side modules the loaded files import but this
path never calls (each an `_Absent` module whose names raise when used, naming themselves). README.md lists them.

    VLLM_SOURCE=DIR moe-lora-harness check --backend examples/vllm_wheel_experts/vllm_wheel_experts.py:VLLM_EXPERTS \
        --only vllm_experts

On a CPU set TRITON_INTERPRET=1 (fp16 and fp32 only: the interpreter cannot compute bf16).
"""
from __future__ import annotations

import functools
import importlib
import math
import os
import sys
import types

import torch
import triton
import triton.language as tl

from moe_lora_harness.harness.spec.source_ops import (init_logger, no_registration, single_rank, source_package,
                                                   max_shared_memory_bytes, set_triton_allocator, stand_in_module,
                                                   tensor_h2d)

ENV_VAR = "VLLM_SOURCE"


# ----------------------------------------------------------------------------------------------------- stand-ins
class _Missing:
    """A name imported from a vLLM module this path never uses: it raises as soon as it is used."""

    def __init__(self, what: str):
        self._what = what

    def _fail(self, *a, **k):
        raise NotImplementedError(f"{self._what}: not stood in by examples/vllm_wheel_experts (vLLM's unquantized "
                                  f"single-rank TritonExperts path does not use it)")

    __call__ = _fail
    __bool__ = _fail
    __iter__ = _fail

    def __or__(self, other):             # in an annotation (`SharedExperts | None`), evaluated at definition
        return self

    __ror__ = __or__

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self._fail()


class _Absent(types.ModuleType):
    """A vLLM module whose names the loaded files import but this path never uses."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self.__name__}.{name}")


class _Platform:
    """vLLM's `current_platform`, answered from torch (no CUDA: the interpreter's CPU, which vLLM never runs on;
    the heuristics then take their CUDA branches' defaults, an H100/H200's SM count and shared memory)."""

    simple_compile_backend = "inductor"

    def is_cuda(self) -> bool:
        return torch.cuda.is_available() and torch.version.hip is None

    def is_cuda_alike(self) -> bool:
        """A GPU, or the Triton interpreter standing in for one (it runs the CUDA path's kernels; vLLM's own CPU
        platform would refuse them, e.g. FusedMoEConfig's non-gated activations)."""
        return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"

    def is_rocm(self) -> bool:
        return torch.cuda.is_available() and torch.version.hip is not None

    def is_xpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return False

    def supports_fp8(self) -> bool:
        return self.has_device_capability(89)

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    def _capability(self, device_id: int = 0) -> int:
        if not torch.cuda.is_available():
            return -1
        major, minor = torch.cuda.get_device_capability(device_id)
        return major * 10 + minor

    def has_device_capability(self, capability, device_id: int = 0) -> bool:
        if isinstance(capability, tuple):
            capability = capability[0] * 10 + capability[1]
        return self._capability(device_id) >= capability

    def is_device_capability(self, capability, device_id: int = 0) -> bool:
        if isinstance(capability, tuple):
            capability = capability[0] * 10 + capability[1]
        return self._capability(device_id) == capability

    def is_device_capability_family(self, capability, device_id: int = 0) -> bool:
        return self._capability(device_id) // 10 == capability // 10

    def num_compute_units(self, device_id: int | None = 0) -> int:
        if not torch.cuda.is_available():
            return 132
        return torch.cuda.get_device_properties(device_id or 0).multi_processor_count

    def get_device_name(self, device_id: int = 0) -> str:
        return torch.cuda.get_device_name(device_id) if torch.cuda.is_available() else "cpu"


def _device_name_as_file_name() -> str:
    """vLLM's tuned-config file key (`NVIDIA_H200`...); "cpu" on a CPU, where no tuned file exists (the defaults)."""
    return _Platform().get_device_name().replace(" ", "_")


class _CustomOp(torch.nn.Module):
    """vLLM's CustomOp registrar: layers/activation.py defines its classes on it (never instantiated here)."""

    @classmethod
    def register(cls, name):
        return lambda c: c

    @classmethod
    def register_oot(cls, *a, **k):
        return lambda c: c


class _LazyDict(dict):
    """vLLM's LazyDict (factories resolved on lookup); layers/activation.py builds its registry of them."""

    def __getitem__(self, key):
        v = super().__getitem__(key)
        return v() if callable(v) else v


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _captured_lora_counts(max_loras: int, specialize: bool) -> list[int]:
    """vllm.lora.utils.get_captured_lora_counts (that module imports transformers and the hub): the launch counts
    graphs are captured for; without specialization the one padded count max_loras + 1."""
    if not specialize:
        return [max_loras + 1]
    return [n for n in range(1, max_loras + 2) if n & (n - 1) == 0 or n == max_loras + 1]


# --- the compiled ops (vllm._custom_ops and torch.ops._C), in torch, rounding where vLLM's CUDA kernels round ------
def _moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
                          expert_map=None, scatter_idx=None):
    """csrc/moe/moe_align_sum_kernels.cu's moe_align_block_size: pairs grouped by expert, each group padded to a
    multiple of block_size with the sentinel topk_ids.numel(); with expert_map (ignore_invalid_experts) only local
    experts count and expert_ids are local. Order inside a block is the flat pair order (the CUDA kernel's differs;
    each row of the GEMM is independent of the others)."""
    if scatter_idx is not None:
        raise NotImplementedError("moe_align_block_size stand-in: scatter_idx is not used by TritonExperts")
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    ids = flat
    if expert_map is not None:
        ids = torch.where(flat >= 0, expert_map.long()[flat.clamp(min=0)], torch.full_like(flat, -1))
        num_experts = int((expert_map >= 0).sum())
    sorted_token_ids.fill_(numel)
    experts_ids.fill_(-1)
    pos = block = 0
    for e in range(num_experts):
        rows = (ids == e).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        n = -(-rows.numel() // block_size) * block_size
        sorted_token_ids[pos:pos + rows.numel()] = rows.to(torch.int32)
        experts_ids[block:block + n // block_size] = e
        pos += n
        block += n // block_size
    num_tokens_post_pad.fill_(pos)


def _moe_lora_align_block_size(*args, **kwargs):
    """csrc's moe_lora_align_block_size: the harness's own exact implementation of vLLM's schema (reference/align.py,
    ours, checked against the invariants of vLLM's kernel by the harness's suites)."""
    from moe_lora_harness.reference.align import moe_lora_align_block_size
    moe_lora_align_block_size(*args, **kwargs)


def _moe_sum(input, output, topk_ids=None, expert_map=None):
    """csrc's moe_sum in vLLM 0.33.0 (its binary's moe_sum_vec_kernel / moe_sum_scalar_kernel): (T, k, H) -> (T, H),
    the k slots summed in fp32 in slot order and rounded once to the output's dtype, for every k. With expert_map,
    slots whose expert is not local are skipped (the pad-aware form TritonExperts calls under EP)."""
    x = input.float()
    if expert_map is not None:
        keep = expert_map.long()[topk_ids.long()] >= 0                                  # (T, k)
        x = torch.where(keep[..., None], x, torch.zeros_like(x))
    acc = torch.zeros_like(x[:, 0])
    for j in range(x.shape[1]):
        acc = acc + x[:, j]
    output.copy_(acc.to(output.dtype))


def _act_then_mul(f):
    """csrc/activation_kernels.cu act_and_mul_kernel: ACT_FN(x) in fp32 rounded to scalar_t, times y in scalar_t."""
    def op(out, input):
        d = input.shape[-1] // 2
        dt = input.dtype
        a = f(input[..., :d].float()).to(dt)
        out.copy_((a.float() * input[..., d:].float()).to(dt))
    return op


def _swigluoai_and_mul(out, input, alpha=1.702, limit=7.0):
    """swigluoai_and_mul (interleaved gate/up): fp32 throughout, one rounding."""
    g = input[..., 0::2].float().clamp(max=limit)
    u = input[..., 1::2].float().clamp(min=-limit, max=limit)
    out.copy_(((u + 1.0) * (g * torch.sigmoid(alpha * g))).to(out.dtype))


def _silu_and_mul_with_clamp(out, input, limit, alpha=1.0, beta=0.0):
    """silu_and_mul_with_clamp (packed gate/up): the gate term rounded to scalar_t, then times (u' + beta) in fp32,
    rounded (the reference's emulation of this kernel, reference/activations.py)."""
    d = input.shape[-1] // 2
    dt = input.dtype
    g = input[..., :d].float().clamp(max=limit)
    u = input[..., d:].float().clamp(min=-limit, max=limit)
    a = (g * torch.sigmoid(alpha * g)).to(dt)
    out.copy_((a.float() * (u + beta)).to(dt))


def _situ_and_mul(out, input, beta, linear_beta):
    """situ_and_mul: fp32 throughout, one rounding; linear_beta <= 0 passes `up` through."""
    d = input.shape[-1] // 2
    g = input[..., :d].float()
    u = input[..., d:].float()
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    m = u if linear_beta <= 0 else linear_beta * torch.tanh(u / linear_beta)
    out.copy_((a * m).to(out.dtype))


_C_OPS = {
    "silu_and_mul": _act_then_mul(lambda x: x / (1.0 + torch.exp(-x))),
    "gelu_and_mul": _act_then_mul(lambda x: x * 0.5 * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))),
    "gelu_tanh_and_mul": _act_then_mul(
        lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))),
    "swigluoai_and_mul": _swigluoai_and_mul,
    "silu_and_mul_with_clamp": _silu_and_mul_with_clamp,
    "situ_and_mul": _situ_and_mul,
}


def _install_c_ops() -> None:
    """torch.ops._C's activation kernels, as attributes of the namespace (vLLM's binary is not loaded; a process
    that has loaded it keeps its own)."""
    ns = torch.ops._C
    for name, fn in _C_OPS.items():
        try:
            getattr(ns, name)
        except (AttributeError, RuntimeError):
            setattr(ns, name, fn)


def _envs() -> dict:
    """vLLM's env flags the loaded files read, at vLLM's defaults."""
    return dict(VLLM_BATCH_INVARIANT=False, VLLM_TUNED_CONFIG_FOLDER=None, VLLM_LORA_DISABLE_PDL=False,
                VLLM_LORA_ENABLE_DUAL_STREAM=False, VLLM_TRITON_USE_TD=None, VLLM_ROCM_USE_AITER_MOE_A4W4_DSV4=False,
                VLLM_DEEPEPLL_NVFP4_DISPATCH=False, VLLM_HUMMING_MOE_GEMM_TYPE=None, VLLM_HUMMING_USE_F16_ACCUM=False,
                VLLM_USE_DEEP_GEMM=False, VLLM_USE_DEEP_GEMM_E8M0=False)


def _stand_ins() -> dict:
    """Module name -> attributes of the small stand-ins (vLLM's helpers the loaded files import)."""
    return {
        "vllm.envs": _envs(),
        "vllm.logger": {"init_logger": init_logger},
        "vllm.platforms": {"current_platform": _Platform(), "vllm_version_matches_substr": lambda s: False,
                           "CpuArchEnum": _Absent("vllm.platforms.CpuArchEnum")},
        "vllm.distributed": {"tensor_model_parallel_all_gather": single_rank,
                             "tensor_model_parallel_all_reduce": single_rank},
        "vllm.triton_utils": {"tl": tl, "triton": triton, "HAS_TRITON": True},
        "vllm.triton_utils.allocation": {"set_triton_allocator": set_triton_allocator},
        "vllm.utils.mem_utils": {"get_max_shared_memory_bytes": max_shared_memory_bytes},
        "vllm.utils.torch_utils": {"async_tensor_h2d": tensor_h2d, "direct_register_custom_op": no_registration,
                                   "PIN_MEMORY": False},
        "vllm.utils.math_utils": {"next_power_of_2": lambda n: 1 << max(int(n) - 1, 0).bit_length(),
                                  "cdiv": lambda a, b: -(a // -b), "round_up": lambda x, y: -(x // -y) * y},
        "vllm.utils.platform_utils": {"get_device_name_as_file_name": _device_name_as_file_name},
        "vllm.utils.gpu_sync_debug": {"gpu_sync_allowed": _NullContext},
        "vllm.utils.multi_stream_utils": {"maybe_execute_in_parallel": _Missing("maybe_execute_in_parallel (dual "
                                                                                "stream: aux_stream is None here)")},
        "vllm.utils.collection_utils": {"LazyDict": _LazyDict},
        "vllm.model_executor.custom_op": {"CustomOp": _CustomOp},
        "vllm._aiter_ops": {"rocm_aiter_ops": types.SimpleNamespace(        # no ROCm AITER: every switch off
            is_fused_moe_enabled=lambda: False, is_fusion_moe_shared_experts_enabled=lambda: False)},
        "vllm.config": {"SchedulerConfig": types.SimpleNamespace(DEFAULT_MAX_NUM_BATCHED_TOKENS_FOR_BATCHED_DP=256),
                        "ParallelConfig": _Missing("vllm.config.ParallelConfig")},
        "vllm.utils.import_utils": {"get_triton_kernels_version": lambda: None},   # no triton_kernels package
        "vllm.lora.utils": {"get_captured_lora_counts": _captured_lora_counts},
        "vllm._custom_ops": {"moe_align_block_size": _moe_align_block_size,
                             "moe_lora_align_block_size": _moe_lora_align_block_size, "moe_sum": _moe_sum},
        "vllm.model_executor.layers.quantization.utils.fp8_utils": {"is_deep_gemm_e8m0_used": lambda: False},
    }


# vLLM modules imported by the loaded files for names this path never uses (engine config, distributed state,
# other backends, quantization kernels): absent, every name raises when used
_ABSENT = (
    "vllm.config.kernel", "vllm.config.lora", "vllm.distributed.parallel_state",
    "vllm.ir", "vllm.utils.deep_gemm",
    "vllm.v1.worker.ubatching", "vllm.v1.worker.workspace",
    "vllm.model_executor.models.utils",
    "vllm.model_executor.layers.fused_moe.routed_experts_capturer",
    "vllm.model_executor.layers.fused_moe.runner.shared_experts",
    "vllm.model_executor.layers.quantization.utils.config_utils",
    "vllm.model_executor.layers.quantization.utils.int8_utils",
    "vllm.model_executor.layers.quantization.utils.mxfp4_utils",
    "vllm.model_executor.layers.quantization.utils.mxfp6_utils",
    "vllm.model_executor.layers.quantization.utils.mxfp8_utils",
    "vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils",
    "vllm.model_executor.layers.quantization.utils.w8a8_utils",
)

# the packages whose files run unchanged, parents first (each mounted once, its __init__ never run)
_PACKAGES = (
    ("vllm", "scalar_type"),
    ("vllm.model_executor.layers", "activation"),
    ("vllm.model_executor.layers.quantization.utils", "quant_utils"),
    ("vllm.lora.ops.triton_ops", "fused_moe_lora_op"),
    ("vllm.model_executor.layers.fused_moe", "fused_moe"),
    ("vllm.model_executor.layers.fused_moe.experts", "triton_moe"),
    ("vllm.lora.layers", "utils"),
    ("vllm.lora.punica_wrapper", "punica_gpu"),
)


def _ensure(name: str, cls=types.ModuleType, **attrs) -> types.ModuleType:
    """`name` in sys.modules (its parents as empty packages), with `attrs` added where missing (a module another
    wrapper stood in first keeps its own values)."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent not in sys.modules:
            stand_in_module(parent, path=[])
    mod = sys.modules.get(name)
    if mod is None:
        return stand_in_module(name, cls, path=[], **attrs)
    for k, v in attrs.items():
        if not hasattr(mod, k):
            setattr(mod, k, v)
    return mod


@functools.cache
def _vllm() -> types.SimpleNamespace:
    """vLLM's modules, loaded from VLLM_SOURCE once per process (ImportError naming the variable when missing)."""
    folders = {pkg: source_package(ENV_VAR, pkg, mod) for pkg, mod in _PACKAGES}   # checked before anything is set
    try:     # vLLM's triton_utils imports it (the op's TMA path reads triton.tools.tensor_descriptor)
        import triton.tools.tensor_descriptor  # noqa: F401
    except ImportError:
        pass
    _install_c_ops()
    for name, attrs in _stand_ins().items():   # a name a stand-in lacks raises when used (env flags: at once)
        _ensure(name, types.ModuleType if name == "vllm.envs" else _Absent, **attrs)
    # ours for the files loaded from here on, also where another wrapper stood vllm.platforms in first (the modules
    # that wrapper loaded keep its platform)
    sys.modules["vllm.platforms"].current_platform = _stand_ins()["vllm.platforms"]["current_platform"]
    for name in _ABSENT:
        _ensure(name, _Absent)
    for pkg, _ in _PACKAGES:                   # a real folder on the package (parents were mounted before children)
        mod = _ensure(pkg)
        if getattr(mod, "__file__", None) is None and folders[pkg] not in list(mod.__path__):
            mod.__path__ = [folders[pkg], *mod.__path__]
    # what the packages' __init__ files would bind (they import every backend of vLLM, so they do not run):
    fm = sys.modules["vllm.model_executor.layers.fused_moe"]
    fm.__dict__.setdefault("get_config", lambda: None)           # no override_config() in effect
    ops_pkg = sys.modules["vllm.lora.ops.triton_ops"]
    op = importlib.import_module("vllm.lora.ops.triton_ops.fused_moe_lora_op")
    meta = importlib.import_module("vllm.lora.ops.triton_ops.lora_kernel_metadata")
    ops_pkg.__dict__.update(fused_moe_lora=op.fused_moe_lora, LoRAKernelMeta=meta.LoRAKernelMeta,
                            lora_shrink=_Missing("vllm.lora.ops.triton_ops.lora_shrink (dense LoRA layers)"),
                            lora_expand=_Missing("vllm.lora.ops.triton_ops.lora_expand (dense LoRA layers)"))
    lora_layers_utils = importlib.import_module("vllm.lora.layers.utils")
    sys.modules["vllm.lora.layers"].__dict__.update(LoRAMapping=lora_layers_utils.LoRAMapping,
                                                     LoRAMappingType=lora_layers_utils.LoRAMappingType)
    cfg = importlib.import_module("vllm.model_executor.layers.fused_moe.config")
    return types.SimpleNamespace(
        config=cfg,
        activation=importlib.import_module("vllm.model_executor.layers.fused_moe.activation"),
        triton_moe=importlib.import_module("vllm.model_executor.layers.fused_moe.experts.triton_moe"),
        lora_context=importlib.import_module("vllm.model_executor.layers.fused_moe.experts.lora_context"),
        punica_gpu=importlib.import_module("vllm.lora.punica_wrapper.punica_gpu"),
        lora_layers_utils=lora_layers_utils, op=op)


# ------------------------------------------------------------------------------------------- the expert call
def _moe_config(v, call, act):
    """vLLM's FusedMoEConfig for the call's layer (one rank, no parallelism beyond the call's expert_map)."""
    cfg = v.config
    x = call.hidden_states
    E_local, H = int(call.w13.shape[0]), int(x.shape[1])
    E_global = int(call.expert_map.numel()) if call.expert_map is not None else E_local
    extra = {}
    if call.activation == "swigluoai_uninterleave":   # gpt-oss style limits as the model config carries them
        extra = dict(swiglu_limit=7.0, swiglu_alpha=1.702, swiglu_beta=1.0)
    return cfg.FusedMoEConfig(
        num_experts=E_global, experts_per_token=int(call.topk_ids.shape[1]), hidden_dim=H,
        intermediate_size=int(call.w2.shape[2]), num_local_experts=E_local, num_logical_experts=E_global,
        activation=act, device=x.device, routing_method=cfg.RoutingMethodType.Renormalize,
        moe_parallel_config=cfg.FusedMoEParallelConfig.make_no_parallel(), in_dtype=x.dtype, max_num_tokens=8192,
        has_bias=call.w13_bias is not None, is_lora_enabled=call.w13_lora_a is not None,
        activation_situ_beta=4.0, activation_situ_linear_beta=25.0, **extra)


def _lora_context(v, call, moe_config):
    """vLLM's MoELoRAContext over vLLM's PunicaWrapperGPU, its metadata set by its own update_metadata from the
    call's token -> slot mapping (slot s holds LoRA id s + 1; id 0 is no adapter)."""
    x = call.hidden_states
    T, L = int(x.shape[0]), int(call.max_loras)
    lora_config = types.SimpleNamespace(max_loras=L, specialize_active_lora=False)   # vllm.config.lora.LoRAConfig's
    punica = v.punica_gpu.PunicaWrapperGPU(max(T, 1), max(T, 1), x.device, lora_config=lora_config)
    ids = tuple(int(m) + 1 if m >= 0 else 0 for m in call.token_lora_mapping.tolist())
    punica.update_metadata(v.lora_layers_utils.LoRAMapping(ids, ids, is_prefill=False),
                           [s + 1 for s in range(L)], L, 1)
    factors = [*call.w13_lora_a, *call.w13_lora_b, *call.w2_lora_a, *call.w2_lora_b]
    return v.lora_context.MoELoRAContext(
        w13_lora_a_stacked=tuple(call.w13_lora_a), w13_lora_b_stacked=tuple(call.w13_lora_b),
        w2_lora_a_stacked=tuple(call.w2_lora_a), w2_lora_b_stacked=tuple(call.w2_lora_b),
        adapter_enabled=call.adapter_enabled, max_loras=L, top_k=int(call.topk_ids.shape[1]),
        w13_num_slices=len(call.w13_lora_a), fully_sharded=False, tp_rank=call.tp_rank, tp_size=call.tp_size,
        local_num_experts=int(call.w13.shape[0]), punica_wrapper=punica, use_tuned_config=False,
        enable_moe_shared_loras=any(int(w.shape[1]) == 1 for w in factors) and int(call.w13.shape[0]) > 1)


def vllm_experts(call) -> None:
    """One ExpertCall through vLLM 0.33.0's TritonExperts: what FusedMoEKernel does around it, in its order (the
    prepare's router weight on the input, the LoRA context's original hidden states, workspaces by the class's own
    workspace_shapes with the output aliasing workspace13 as `_allocate_buffers` does, apply, the class's finalize)."""
    if call.ep_comm is not None or call.fully_sharded or call.quant != "none":
        raise NotImplementedError("vllm_experts wires neither dispatched EP, fully-sharded LoRA nor quantized weights")
    v = _vllm()
    x = call.hidden_states
    T, H = int(x.shape[0]), int(x.shape[1])
    if T == 0:                                            # the modular kernel returns before the experts
        return
    act = v.activation.MoEActivation.from_str(call.activation)
    moe_config = _moe_config(v, call, act)
    cfg = v.config
    quant_config = (cfg.biased_moe_quant_config(call.w13_bias, call.w2_bias) if call.w13_bias is not None
                    else cfg.FUSED_MOE_UNQUANTIZED_CONFIG)
    experts = v.triton_moe.TritonExperts(moe_config, quant_config)
    ctx = None
    if call.w13_lora_a is not None:
        ctx = _lora_context(v, call, moe_config)
        experts.set_lora_context(ctx)
        ctx.original_hidden_states = x
    a1 = x
    if call.apply_router_weight_on_input:                 # MoEPrepareAndFinalizeNoDPEPModular.prepare
        a1 = a1 * call.topk_weights.to(a1.dtype)
    E, M, N, K, top_k = experts.moe_problem_size(a1, call.w13, call.w2, call.topk_ids)
    G = int(call.expert_map.numel()) if call.expert_map is not None else E
    ws13, ws2, out_shape = experts.workspace_shapes(M, N, K, top_k, G, E, None, act)
    dt = experts.workspace_dtype(x.dtype)
    common = torch.empty((max(math.prod(ws13), math.prod(out_shape)),), dtype=dt, device=x.device)
    workspace13 = common[:math.prod(ws13)].view(*ws13)
    workspace2 = torch.empty(ws2, dtype=dt, device=x.device)
    fused_out = common[:math.prod(out_shape)].view(*out_shape)
    experts.apply(output=fused_out, hidden_states=a1, w1=call.w13, w2=call.w2, topk_weights=call.topk_weights,
                  topk_ids=call.topk_ids, activation=act, global_num_experts=G, expert_map=call.expert_map,
                  a1q_scale=None, a2_scale=experts.a2_scale, workspace13=workspace13, workspace2=workspace2,
                  expert_tokens_meta=None, apply_router_weight_on_input=call.apply_router_weight_on_input)
    experts.finalize_weight_and_reduce_impl().apply(
        output=call.output, fused_expert_output=fused_out, topk_weights=call.topk_weights, topk_ids=call.topk_ids,
        apply_router_weight_on_input=call.apply_router_weight_on_input)
    if ctx is not None:
        ctx.original_hidden_states = None


# --- declared as a user who has read vLLM's source would (imports of the harness's public contract) -------------
from moe_lora_harness.harness.spec.contract import BackendSpec, Capabilities, Rule  # noqa: E402
from moe_lora_harness.reference.precision import vllm_dispatch_path  # noqa: E402

SPARSITY_FACTOR = 8     # punica_gpu.add_lora_w13's naive-block rule


def _path(case) -> str:
    """The LoRA op path both of TritonExperts' deltas take (add_lora_w13 picks the block assignment, add_lora_w2
    reuses it; the op dispatches on it): vLLM's rule, with the layer's local experts."""
    if not case.lora:
        return "one_shot"          # no LoRA: the base GEMMs alone, which every preset rounds alike
    expert_map = case.ep_size > 1
    naive = not expert_map and case.T * case.top_k * SPARSITY_FACTOR <= case.local_experts * case.max_loras
    return vllm_dispatch_path(naive=naive, max_rank=case.max_rank, num_pairs=case.T * case.top_k,
                              fully_sharded=False)


def _cuda_precision(case) -> str:
    """fp32 on a GPU: fused_moe_kernel's and the LoRA op's `tl.dot` take no input_precision, so TF32 with the
    operands' low bits dropped (Triton's default)."""
    return f"{_path(case)}_tf32rz" if case.dtype == "float32" else _path(case)


_FP8 = ("not wired: vLLM's FP8 TritonExperts path quantizes activations with compiled vLLM ops "
        "(per_token_group_quant_fp8, scaled_fp8_quant) this wrapper does not stand in")
_WNA16 = ("weight-only int4/int8 weights run in another vLLM class (TritonWNA16Experts / Marlin), not TritonExperts")

VLLM_EXPERTS = BackendSpec(
    name="vllm_experts",
    description="vLLM 0.33.0's TritonExperts + LoRAExpertsMixin from its wheel (examples/vllm_wheel_experts): its "
                "fused_moe_kernel GEMM, punica add_lora_w13/w2 and fused_moe_lora; compiled ops stood in",
    capabilities=Capabilities(
        levels=frozenset({"expert"}),
        dtypes={"cpu": frozenset({"float16", "float32"}),
                "cuda": frozenset({"float16", "bfloat16", "float32"})},
        dtype_reasons={("cpu", "bfloat16"): "the Triton interpreter cannot compute bfloat16 (it runs on a GPU)"},
        activations=frozenset({"silu", "gelu", "gelu_tanh", "swigluoai", "situ", "swigluoai_uninterleave",
                               "swiglustep", "silu_no_mul", "gelu_no_mul", "gelu_tanh_no_mul", "relu2_no_mul"}),
        reasons={("activation", "relu2"): "TritonExperts._supports_activation declines it (apply_moe_activation "
                                          "has no gated relu2)",
                 ("quant", "fp8_w8a8"): _FP8, ("quant", "fp8_block"): _FP8,
                 ("quant", "int4_g128"): _WNA16, ("quant", "int8_channel"): _WNA16},
        non_gated=True, bias=True, lora=True, base_only=True, expert_map=True, shared_lora=True,
        tensor_parallel=True,
        fully_sharded=False,          # support_for's message: "fully_sharded LoRA not supported"
        expert_parallel=False,        # dispatched EP: vLLM's all2all prepare/finalize are not wired
        quant=frozenset({"none"}),
        rules=(Rule("round_up(E, 32) < 1024", lambda c: -(-c.E // 32) * 32 < 1024,
                    "TritonExperts.is_supported_config: moe_align_block_size needs fewer than 1024 padded experts"),)),
    experts=vllm_experts,
    precision={"cpu": _path, "cuda": _cuda_precision},
    # vLLM's kernels (and the stand-ins, written to round where vLLM's CUDA ops do) round where the model does; the
    # CPU's interpreter sums each tl.dot in fp32. Not yet declared on CUDA, not measured there with the declaration
    model_points_only={"cpu": True})
