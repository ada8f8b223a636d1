"""vLLM 0.33.0's real LoRA MoE layer, installed (`pip install vllm==0.33.0`), as a layer-level `--backend`.

A user's wrapper, not part of the harness. Everything that decides a value is vLLM's own, unchanged:

    FusedMoEFactory(...)                 the MoERunner (router, RoutedExperts, the TRITON unquantized backend that
                                         vLLM's oracle selects whenever LoRA is enabled: TritonExperts)
    FusedMoEWithLoRA(runner)             + create_lora_weights(max_loras, LoRAConfig)
    PunicaWrapperGPU(...)                + layer.set_mapping(punica), once, as LoRAModelManager does
    load_adapter(slot, a)                -> set_lora(slot, [w1_a, w2_a, w3_a], [w1_b, w2_b, w3_b]) (what the manager's
                                            activate_adapter does; factors cast to lora_dtype, `B *= scaling` after)
    unload_adapter(slot)                 -> the slot's id dropped from lora_index_to_id (the manager's
                                            _deactivate_adapter: vLLM calls no reset_lora on unload)
    set_mapping(mapping)                 -> slots turned into adapter ids, LoRAMapping, punica.update_metadata(mapping,
                                            lora_index_to_id, max_loras + 1, vocab_size) (the manager's call)
    forward(batch)                       -> layer.forward(hidden_states, router_logits) in vLLM's forward context
                                            (the layer routes itself)

No padding of the mapping, no mapping fix: the harness's slots become ids exactly as vLLM's runner hands ids over.

**What is not vLLM's on a CPU** (vLLM has no CPU path for this layer; each item is environment or a compiled op):

- the platform: `VLLM_TARGET_DEVICE=cpu` (vLLM's CpuPlatform; its CPURouter routes in torch) and
  `CUDA_VISIBLE_DEVICES=` (so vLLM's `triton_utils` keeps Triton with no active GPU driver; Triton then runs in its
  interpreter, `TRITON_INTERPRET=1`). With LoRA enabled vLLM's oracle picks TritonExperts on any platform, and the
  wrapper builds vLLM's PunicaWrapperGPU itself (CpuPlatform's selector would name PunicaWrapperCPU, which has no MoE
  ops).
- four compiled ops: vLLM's `_moe_C` / `_C` libraries need the CUDA driver (`libcuda.so.1`) to load at all, and hold
  CUDA kernels only. They are registered here, under vLLM's own op names and schemas, as small torch functions with
  the CUDA kernels' semantics and rounding points (`_STAND_INS` below): `_moe_C::moe_align_block_size`,
  `_moe_C::moe_lora_align_block_size`, `_moe_C::moe_sum`, `_C::silu_and_mul`. Only when vLLM's library is not
  loaded; a process that has it keeps vLLM's.

    TRITON_INTERPRET=1 /work/venv-vllm/bin/python -m moe_lora_harness check \
        --backend examples/vllm_real_layer/vllm_real_layer.py:VLLM_REAL_LAYER --only vllm_real_layer

README.md says what passes and what it found.
"""
from __future__ import annotations

import os
import socket

import torch

_ON_GPU = torch.cuda.is_available()
if not _ON_GPU:
    # vLLM's CPU platform; keep Triton usable without a GPU driver (vllm/triton_utils/importing.py accepts zero active
    # drivers only where CUDA_VISIBLE_DEVICES is set and empty)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

from moe_lora_harness import BackendSpec, Capabilities, ExpertAdapter, LayerBatch, LayerConfig, LayerWeights  # noqa: E402
from moe_lora_harness.reference.precision import vllm_dispatch_path  # noqa: E402


# ------------------------------------------------------------------------------------- stand-ins for compiled ops
def _moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
                          maybe_expert_map=None, scatter_idx=None):
    """moe_align_block_size: the (token, k) pairs grouped by expert in flat order, each group padded to a multiple of
    block_size with the sentinel topk_ids.numel(), the rest of sorted_token_ids the sentinel, unused blocks' expert -1,
    the padded total in num_tokens_post_pad. (The CUDA kernel's order inside a group may differ; every row of the GEMM
    is computed on its own.)"""
    if maybe_expert_map is not None or scatter_idx is not None:
        raise NotImplementedError("moe_align_block_size stand-in: expert_map / scatter_idx (single rank only)")
    flat = topk_ids.reshape(-1).long()
    sorted_token_ids.fill_(flat.numel())
    experts_ids.fill_(-1)
    pos = 0
    for e in range(int(num_experts)):
        rows = (flat == e).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        n = -(-rows.numel() // block_size) * block_size
        sorted_token_ids[pos:pos + rows.numel()] = rows.to(torch.int32)
        experts_ids[pos // block_size:(pos + n) // block_size] = e
        pos += n
    num_tokens_post_pad.fill_(pos)


def _moe_lora_align_block_size(topk_ids, token_lora_mapping, num_experts, block_size, max_loras,
                               max_num_tokens_padded, max_num_m_blocks, sorted_token_ids, experts_ids,
                               num_tokens_post_pad, adapter_enabled, lora_ids, maybe_expert_map=None):
    """moe_lora_align_block_size: the harness's own exact implementation of vLLM's schema (reference/align.py, as
    examples/vllm_wheel_experts stands it in), over the first T entries of the token -> LoRA buffer, which is all
    the CUDA kernel reads of it (the buffer is sized for the largest batch; the rest is whatever it held)."""
    if maybe_expert_map is not None:
        raise NotImplementedError("moe_lora_align_block_size stand-in: expert_map (single rank only)")
    from moe_lora_harness.reference.align import moe_lora_align_block_size
    moe_lora_align_block_size(topk_ids, token_lora_mapping[:topk_ids.shape[0]], num_experts, block_size, max_loras,
                              max_num_tokens_padded, max_num_m_blocks, sorted_token_ids, experts_ids,
                              num_tokens_post_pad, adapter_enabled, lora_ids)


def _moe_sum(input, output, topk_ids=None, expert_map=None):
    """moe_sum (0.33.0's binary holds moe_sum_vec_kernel / moe_sum_scalar_kernel): the k expert outputs of each token
    summed in fp32, rounded once to the output dtype."""
    if expert_map is not None:
        raise NotImplementedError("moe_sum stand-in: expert_map (single rank only)")
    output.copy_(input.float().sum(dim=1).to(output.dtype))


def _silu_and_mul(result, input):
    """silu_and_mul (act_and_mul_kernel): silu(gate) computed in fp32 and rounded to the dtype, times up in the
    dtype (one rounding)."""
    d = input.shape[-1] // 2
    g = input[..., :d].float()
    a = (g / (1.0 + torch.exp(-g))).to(input.dtype)
    result.copy_((a.float() * input[..., d:].float()).to(result.dtype))


_STAND_INS = {
    ("_moe_C", "moe_align_block_size"): (
        "moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, Tensor(a!) sorted_token_ids, "
        "Tensor(b!) experts_ids, Tensor(c!) num_tokens_post_pad, Tensor? maybe_expert_map, "
        "Tensor(d!)? scatter_idx=None) -> ()", _moe_align_block_size),
    ("_moe_C", "moe_lora_align_block_size"): (
        "moe_lora_align_block_size(Tensor topk_ids, Tensor token_lora_mapping, int num_experts, int block_size, "
        "int max_loras, int max_num_tokens_padded, int max_num_m_blocks, Tensor(a!) sorted_token_ids, "
        "Tensor(b!) experts_ids, Tensor(c!) num_tokens_post_pad, Tensor(d!) adapter_enabled, Tensor(e!) lora_ids, "
        "Tensor? maybe_expert_map) -> ()", _moe_lora_align_block_size),
    ("_moe_C", "moe_sum"): (
        "moe_sum(Tensor input, Tensor(a!) output, Tensor? topk_ids=None, Tensor? expert_map=None) -> ()", _moe_sum),
    ("_C", "silu_and_mul"): ("silu_and_mul(Tensor(a!) result, Tensor input) -> ()", _silu_and_mul),
}
_LIBS = []      # keeps the torch.library registrations alive


def _install_stand_ins() -> list:
    """Register the stand-ins where vLLM's compiled op is absent; the names of those registered."""
    done = []
    for (ns, name), (schema, fn) in _STAND_INS.items():
        if hasattr(getattr(torch.ops, ns), name):
            continue                       # vLLM's own library is loaded: keep its op
        lib = torch.library.Library(ns, "FRAGMENT")
        lib.define(schema)
        lib.impl(name, fn, "CPU")
        _LIBS.append(lib)
        done.append(f"{ns}::{name}")
    return done


import vllm  # noqa: E402,F401
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.config.lora import LoRAConfig  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.lora.layers import LoRAMapping  # noqa: E402
from vllm.lora.layers.fused_moe import FusedMoEWithLoRA  # noqa: E402
from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU  # noqa: E402
from vllm.model_executor.layers.fused_moe import FusedMoEFactory  # noqa: E402

STOOD_IN = _install_stand_ins() if not _ON_GPU else []
VOCAB_SIZE = 32000          # update_metadata's vocab_size: only the embedding indices read it
MAX_RANKS = frozenset({1, 8, 16, 32, 64, 128, 256, 320, 512})   # LoRAConfig.max_lora_rank's allowed values


# ----------------------------------------------------------------------------------------------- environment
def setup() -> None:
    """Once per process: vLLM's single-rank distributed state (gloo, world size 1) and model-parallel groups."""
    from vllm.distributed.parallel_state import (init_distributed_environment, initialize_model_parallel,
                                                 model_parallel_is_initialized)
    if model_parallel_is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo" if not _ON_GPU else "nccl",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)


# ----------------------------------------------------------------------------------------------- the wrapper
_COUNTER = [0]


class VllmRealLayer:
    """vLLM's FusedMoEWithLoRA over its MoERunner, driven through the harness's layer methods. The twin
    (`lora_enabled=False`) is the same MoERunner built under the same LoRA-enabled VllmConfig (so vLLM selects the
    same TritonExperts), not wrapped, never given an adapter or a mapping."""

    def __init__(self, config: LayerConfig, weights: LayerWeights):
        if config.quant != "none" or config.bias or config.activation != "silu":
            raise ValueError(f"vllm_real_layer wires unquantized, bias-free silu layers only (got quant={config.quant}, "
                             f"bias={config.bias}, activation={config.activation})")
        if config.max_rank not in MAX_RANKS:
            raise ValueError(f"max_rank {config.max_rank}: vLLM's LoRAConfig allows {sorted(MAX_RANKS)}")
        self.config = config
        self.dtype = config.torch_dtype
        self.lora_dtype = config.lora_torch_dtype
        self.device = torch.device(config.device)
        self.max_seqs = config.max_num_seqs or config.max_tokens
        self.lora_config = LoRAConfig(max_loras=config.max_loras, max_lora_rank=config.max_rank,
                                      lora_dtype=self.lora_dtype)
        self.vllm_config = VllmConfig()
        # set after construction: VllmConfig's own check of a LoRA config needs a model config this layer has not
        self.vllm_config.lora_config = self.lora_config
        _COUNTER[0] += 1
        with set_current_vllm_config(self.vllm_config):
            runner = FusedMoEFactory(num_experts=config.E, top_k=config.top_k, hidden_size=config.H,
                                     intermediate_size=config.I, params_dtype=self.dtype,
                                     renormalize=config.renormalize, activation=config.activation,
                                     prefix=f"vllm_real_layer.{_COUNTER[0]}.experts")
            runner.to(self.device)
            experts = runner.routed_experts
            experts.w13_weight.data.copy_(weights.w13)       # (E, 2I, H): gate rows first, as vLLM's w13 (w1; w3)
            experts.w2_weight.data.copy_(weights.w2)         # (E, H, I)
            experts.quant_method.process_weights_after_loading(experts)
            self.runner = runner
            self.layer = None
            if config.lora_enabled:
                self.layer = FusedMoEWithLoRA(runner)
                self.layer.create_lora_weights(config.max_loras, self.lora_config, None)
                self.punica = PunicaWrapperGPU(config.max_tokens, self.max_seqs, self.device,
                                               lora_config=self.lora_config)
                self.layer.set_mapping(self.punica)
        self.lora_index_to_id: list = [None] * config.max_loras
        self._next_id = 1

    # -- adapters ----------------------------------------------------------------------------------------------
    def load_adapter(self, slot: int, adapter: ExpertAdapter) -> None:
        """activate_adapter: set_lora(slot, [w1_a, w2_a, w3_a], [w1_b, w2_b, w3_b]) with every factor in lora_dtype
        and each module's scaling folded into its B after the cast; each module at its own rank (set_lora copies
        each factor into the top-left corner of the slot, after its reset). The slot gets a fresh adapter id."""
        dt, dev = self.lora_dtype, self.device

        def a(t):
            return t.to(device=dev, dtype=dt)

        def b(t, scaling):
            t = t.to(device=dev, dtype=dt).clone()
            t *= scaling
            return t

        lora_a = [a(adapter.gate_a), a(adapter.down_a), a(adapter.up_a)]
        lora_b = [b(adapter.gate_b, adapter.scaling), b(adapter.down_b, adapter.w2_scaling),
                  b(adapter.up_b, adapter.scaling)]
        self.layer.set_lora(slot, lora_a, lora_b)
        self.lora_index_to_id[slot] = self._next_id
        self._next_id += 1

    def unload_adapter(self, slot: int) -> None:
        """_deactivate_adapter: the slot's id leaves lora_index_to_id (vLLM does not call reset_lora here)."""
        self.lora_index_to_id[slot] = None

    # -- mapping and forward -----------------------------------------------------------------------------------
    def set_mapping(self, mapping: torch.Tensor) -> None:
        """The runner's LoRAMapping of this batch (adapter ids per token, 0 = none; one request per token, or per
        run of equal ids when the batch has more tokens than max_num_seqs), handed to update_metadata as the LoRA
        manager does."""
        ids = []
        for s in mapping.tolist():
            if s < 0:
                ids.append(0)
            elif self.lora_index_to_id[s] is None:
                raise KeyError(f"slot {s} holds no adapter: vLLM maps adapter ids and cannot name an unloaded slot")
            else:
                ids.append(self.lora_index_to_id[s])
        prompt = ids
        if len(ids) > self.max_seqs:
            prompt = [x for i, x in enumerate(ids) if i == 0 or ids[i - 1] != x]
            if len(prompt) > self.max_seqs:
                raise ValueError(f"{len(prompt)} requests > max_num_seqs {self.max_seqs}")
        lm = LoRAMapping(index_mapping=tuple(ids), prompt_mapping=tuple(prompt), is_prefill=len(prompt) < len(ids))
        self.punica.update_metadata(lm, self.lora_index_to_id, self.config.max_loras + 1, VOCAB_SIZE)

    def forward(self, batch: LayerBatch) -> torch.Tensor:
        """The layer's forward in vLLM's forward context; it routes itself from the logits."""
        mod = self.layer if self.layer is not None else self.runner
        with set_current_vllm_config(self.vllm_config), set_forward_context(None, self.vllm_config):
            out = mod.forward(batch.hidden_states, batch.router_logits)
        return out


class VllmRealLayerPadded(VllmRealLayer):
    """The same layer driven through padded batches the way vLLM's runner drives a cudagraph-sized batch, without
    the graph (a CPU has none): `capture(size)` only notes the size; `replay(batch)` runs the layer's forward on all S
    rows of the batch while the punica metadata holds the mapping of the T scheduled tokens only (vLLM's runner writes
    T entries into its token -> LoRA buffer, and the LoRA ops read the first S of it). Stale state that only a real
    capture would freeze is not exercised; the padding semantics are."""

    def __init__(self, config: LayerConfig, weights: LayerWeights):
        super().__init__(config, weights)
        self.captured: set = set()

    def capture(self, size: int) -> None:
        if size not in self.config.capture_sizes or size > self.config.max_tokens:
            raise ValueError(f"capture size {size} not in capture_sizes {self.config.capture_sizes}")
        self.captured.add(size)

    def replay(self, batch: LayerBatch) -> torch.Tensor:
        S = batch.num_tokens
        if S not in self.captured:
            raise ValueError(f"replay at {S} tokens: captured {sorted(self.captured)}")
        return self.forward(batch)


def make_layer(config: LayerConfig, weights: LayerWeights) -> VllmRealLayer:
    """BackendSpec.layer (the twin with config.lora_enabled False)."""
    return VllmRealLayer(config, weights)


def make_padded_layer(config: LayerConfig, weights: LayerWeights) -> VllmRealLayerPadded:
    """BackendSpec.layer of VLLM_REAL_LAYER_PADDED."""
    return VllmRealLayerPadded(config, weights)


SPARSITY_FACTOR = 8     # punica_gpu.add_lora_w13's naive-block rule


def _path(case) -> str:
    """The LoRA op path (and so the rounding preset) of a batch: add_lora_w13 picks naive blocks when
    T * top_k * 8 <= E * max_loras, and fused_moe_lora dispatches on that, the rank and T * top_k."""
    if not case.lora:
        return "one_shot"
    naive = case.T * case.top_k * SPARSITY_FACTOR <= case.E * case.max_loras
    return vllm_dispatch_path(naive=naive, max_rank=case.max_rank, num_pairs=case.T * case.top_k, fully_sharded=False)


_CPU_ONLY = ("this wrapper sets vLLM's CPU platform and stands in compiled ops; on a GPU build the layer under "
             "vLLM's CUDA platform instead (not wired here)")

VLLM_REAL_LAYER = BackendSpec(
    name="vllm_real_layer",
    description="vLLM 0.33.0's own FusedMoEWithLoRA (MoERunner + TritonExperts, set_lora, LoRAModelManager's unload, "
                "PunicaWrapperGPU.update_metadata, forward), installed vLLM; on a CPU four compiled ops stood in",
    capabilities=Capabilities(
        levels=frozenset({"layer"}),
        devices=frozenset({"cpu"}),
        device_reasons={"cuda": _CPU_ONLY},
        dtypes={"cpu": frozenset({"float16", "float32"})},
        dtype_reasons={("cpu", "bfloat16"): "the Triton interpreter cannot compute bfloat16 (it runs on a GPU)"},
        activations=frozenset({"silu"}),
        reasons={("activation", a): "only silu_and_mul is stood in" for a in
                 ("gelu", "gelu_tanh", "swigluoai", "swigluoai_uninterleave", "situ", "swiglustep", "relu2",
                  "silu_no_mul", "gelu_no_mul", "gelu_tanh_no_mul", "relu2_no_mul")},
        non_gated=False,
        bias=False,
        quant=frozenset({"none"}),
        fully_sharded=False,
        expert_map=False,
        shared_lora=False,
        graphs=False,                      # CUDA graphs need a GPU
        max_tokens=None,
        slot_reuse=True,                   # set_lora resets the slot before copying
        maps_unloaded_slots=False,         # vLLM maps adapter ids; an unloaded id cannot be named
        layer_max_ranks=MAX_RANKS,
    ),
    layer=make_layer,
    setup=setup,
    precision=_path,
)

# The same layer with vLLM's padded batches (eager: no CUDA graph on a CPU): the harness's graph rows then judge the
# padding semantics of issue 31 (the mapping of T tokens, a forward of S >= T rows).
import dataclasses  # noqa: E402

VLLM_REAL_LAYER_PADDED = dataclasses.replace(
    VLLM_REAL_LAYER, name="vllm_real_layer_padded",
    description="vllm_real_layer driven through padded batches as vLLM's runner pads to a cudagraph size "
                "(capture notes the size, replay runs the eager forward on all S rows with the T-token mapping)",
    capabilities=dataclasses.replace(VLLM_REAL_LAYER.capabilities, graphs=True),
    layer=make_padded_layer)
