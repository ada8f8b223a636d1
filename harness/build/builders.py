"""Turn a `Case` into tensors on a device, deterministically from its seed.

On a CUDA device every tensor is drawn there, from generators of that device seeded as on the CPU (the case and
the device kind determine the values; they differ from the CPU's); on the CPU (and any other device, built on the
CPU and moved) the values are what they always were. Where a run's case is drawn: `draw_device` (a small case of a
CUDA run on the CPU). docs/architecture.md, "The judge on the device".

Inputs are never zeros and are scaled so that every term matters: a LoRA delta is about as large as the
value it is added to, routing weights are distinct, so a dropped expert, a missing delta or a wrong
weight gives a gross error rather than a rounding-sized one.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from moe_lora_harness.harness.spec.case import OUTLIER_SCALE, Case  # noqa: F401 (tests read the default here)
from moe_lora_harness.op_contract.validate import default_tuning
from moe_lora_harness.reference import align as ref_align

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


ADAPTER_SCALING = 0.5     # every expert-level adapter's scaling (alpha / r), folded into its B when packed


def torch_dtype(case: Case) -> torch.dtype:
    return TORCH_DTYPES[case.dtype]


def build_device(device) -> torch.device:
    """Where tensors are drawn for a run on `device`: that CUDA device, else the CPU."""
    d = torch.device(device)
    return d if d.type == "cuda" else torch.device("cpu")


# A CUDA run's case within both is drawn on the CPU (and copied to the GPU for the backend), and judged there: jobs
# sharing one GPU then do not queue their judges' many small launches behind each other's (issue 32's throughput)
SMALL_ELEMENTS = 1 << 22     # the inputs' elements (harness.build.case_memory.memory_need)
SMALL_WORK = 1 << 25         # the float64 reference's multiply-adds (harness.build.case_memory.reference_work)


def draw_device(case: Case, device) -> torch.device:
    """Where the judge and the worker draw `case`'s inputs for a run on `device`: `build_device(device)`, but the
    CPU for a small case (SMALL_ELEMENTS, SMALL_WORK), so that the judge computes it there."""
    from moe_lora_harness.harness.build.case_memory import _ITEM, memory_need, reference_work
    at = build_device(device)
    if at.type == "cuda" and memory_need(case).inputs <= SMALL_ELEMENTS * _ITEM[case.dtype] \
            and reference_work(case) <= SMALL_WORK:
        return torch.device("cpu")
    return at


def _gen(case: Case, salt: int, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed((case.seed * 1_000_003 + salt) % (2**63))


def outlier_tokens(case: Case, device="cpu") -> torch.Tensor:
    """The `case.outliers` token indices (int64, ascending) whose hidden states are scaled `case.outlier_scale`
    more; drawn from a generator of their own, so no other tensor of the case changes."""
    if case.outliers <= 0 or case.T <= 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return torch.randperm(case.T, generator=_gen(case, 5, device), device=device)[:case.outliers].sort().values


def scale_inputs(case: Case, x: torch.Tensor, rows_per_token: int = 1) -> torch.Tensor:
    """`x` (T * rows_per_token, K; token t's rows together) times `case.magnitude`, the outlier tokens' rows
    times `case.outlier_scale` more. The defaults return `x` itself (bit-identical inputs for every existing case)."""
    if case.magnitude == 1 and case.outliers == 0:
        return x
    scale = torch.full((x.shape[0], 1), float(case.magnitude), dtype=x.dtype, device=x.device)
    for t in outlier_tokens(case, x.device).tolist():
        scale[t * rows_per_token:(t + 1) * rows_per_token] *= float(case.outlier_scale)
    return x * scale


def scale_prior(case: Case, out: torch.Tensor) -> torch.Tensor:
    """The op's output buffer (its prior values) times `case.magnitude`; itself at magnitude 1."""
    return out if case.magnitude == 1 else out * float(case.magnitude)


NEGATIVE_ZERO_SHARE = 1 / 16


def with_negative_zeros(case: Case, t: torch.Tensor, salt: int) -> torch.Tensor:
    """`t` with about one element in NEGATIVE_ZERO_SHARE set to -0.0, chosen from a generator of its own (no
    other tensor changes): a kernel that rewrites an element it must leave alone (adding a zero to it) turns
    -0.0 into +0.0, which the bit-for-bit comparison of untouched elements sees."""
    if t.numel() == 0:
        return t
    pick = torch.rand(t.shape, generator=_gen(case, salt, t.device), device=t.device) < NEGATIVE_ZERO_SHARE
    return torch.where(pick, torch.full_like(t, -0.0), t)


def make_routing(case: Case, g: torch.Generator):
    """(topk_weights fp32 (T,k), topk_ids int32 (T,k)) with k distinct global experts per token (on g's device)."""
    T, E, k = case.T, case.E, case.top_k
    dev = g.device
    logits = torch.zeros(T, E, dtype=torch.float64, device=dev)
    if case.routing == "skewed":   # a few hot experts take most tokens
        logits = logits - 1.5 * torch.arange(E, dtype=torch.float64, device=dev)
    gumbel = -torch.log(-torch.log(torch.rand(T, E, generator=g, dtype=torch.float64, device=dev).clamp_min(1e-12)))
    ids = torch.argsort(logits + gumbel, dim=1, descending=True)[:, :k].to(torch.int32)
    w = torch.softmax(torch.randn(T, k, generator=g, device=dev), dim=1)
    if k == 1:   # a softmax over one slot is exactly 1.0 and would hide a missing or doubled weight
        w = 0.25 + 0.75 * torch.rand(T, 1, generator=g, device=dev)
    w = w.to(torch.float32)
    return w.contiguous(), ids.contiguous()


def make_token_lora_mapping(case: Case, g: torch.Generator) -> torch.Tensor:
    """Token -> LoRA slot index in [0, L) or -1, following `case.mapping` (on g's device)."""
    T, L = case.T, case.max_loras
    dev = g.device
    if case.mapping == "none":
        return torch.full((T,), -1, dtype=torch.int32, device=dev)
    m = torch.randint(0, L, (T,), generator=g, dtype=torch.int32, device=dev)
    if case.mapping == "mixed":      # about a third of the tokens carry no adapter
        m = torch.where(torch.rand(T, generator=g, device=dev) < 0.35, torch.full_like(m, -1), m)
    elif case.mapping == "skewed":   # one adapter takes most tokens
        m = torch.where(torch.rand(T, generator=g, device=dev) < 0.8, torch.zeros_like(m), m)
    elif case.mapping == "by_rank":  # EP rank r's tokens use slot r % L only (every third one none): each
        # adapter is used by one rank's tokens, and every other rank must still run it for them
        counts = case.ep_tokens or (T,)
        m = torch.cat([torch.full((n,), r % L, dtype=torch.int32, device=dev) for r, n in enumerate(counts)])
        m[1::3] = -1
    return m


def adapter_enabled_for(case: Case, device="cpu") -> torch.Tensor:
    """(L+1,) int32: 1 where a slot holds an adapter; `disabled` turns slot 0 off; entry L is never set."""
    en = torch.tensor([1 if r > 0 else 0 for r in case.slot_ranks] + [0], dtype=torch.int32, device=device)
    if case.mapping == "disabled":
        en[0] = 0
    return en


def make_lora_stack(case: Case, g: torch.Generator, *, num_slices: int, K: int, N: int, E_local: int,
                    dtype: torch.dtype):
    """S x A (L, E|1, R, K) and S x B (L, E|1, N, R): slot ranks zero-padded to max_rank (on g's device).

    A shared factor is made with expert-dim 1 and handed over as a stride-0 expanded view, as
    production's LoRA mixin does.
    """
    L, R = case.max_loras, case.max_rank
    dev = g.device
    Ea = 1 if case.shared_a else E_local
    Eb = 1 if case.shared_b else E_local
    A_list, B_list = [], []
    for _ in range(num_slices):
        A = torch.zeros(L, Ea, R, K, dtype=torch.float64, device=dev)
        B = torch.zeros(L, Eb, N, R, dtype=torch.float64, device=dev)
        for l, r in enumerate(case.slot_ranks):
            if r == 0:
                continue
            A[l, :, :r, :] = torch.randn(Ea, r, K, generator=g, dtype=torch.float64, device=dev) / math.sqrt(K)
            B[l, :, :, :r] = torch.randn(Eb, N, r, generator=g, dtype=torch.float64, device=dev) / math.sqrt(r)
        A, B = A.to(dtype), B.to(dtype)
        if case.shared_a:
            A = A.expand(L, E_local, R, K)
        if case.shared_b:
            B = B.expand(L, E_local, N, R)
        A_list.append(A)
        B_list.append(B)
    return A_list, B_list


@dataclass
class OpInputs:
    """Every argument of a `fused_moe_lora` call, plus what the reference needs beside them."""

    case: Case
    output: torch.Tensor
    x: torch.Tensor
    lora_a: list
    lora_b: list
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    sorted_token_ids: torch.Tensor | None
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor | None
    token_lora_mapping: torch.Tensor
    lora_ids: torch.Tensor
    num_active_loras: torch.Tensor
    adapter_enabled: torch.Tensor
    expert_map: torch.Tensor | None = None

    def call_kwargs(self) -> dict:
        """Keyword arguments for vLLM 0.33.0's `fused_moe_lora` signature."""
        c = self.case
        return dict(
            output=self.output, qcurr_hidden_states=self.x, lora_a_stacked=self.lora_a,
            lora_b_stacked=self.lora_b, topk_weights=self.topk_weights,
            sorted_token_ids=self.sorted_token_ids, expert_ids=self.expert_ids,
            num_tokens_post_padded=self.num_tokens_post_padded,
            token_lora_mapping=self.token_lora_mapping, max_lora_rank=c.max_rank,
            top_k_num=c.top_k, lora_ids=self.lora_ids, num_active_loras=self.num_active_loras,
            adapter_enabled=self.adapter_enabled,
            **default_tuning(c.block_size_m),   # BLOCK_M is the align block size
            mul_routed_weight=c.mul_routed_weight, fully_sharded=c.fully_sharded,
            offset=c.offset, add_inputs=c.add_inputs,
        )

    def to(self, device) -> "OpInputs":
        """A copy on another device (num_active_loras stays on the CPU, as in production)."""
        def mv(t):
            if t is None:
                return None
            if isinstance(t, list):
                return [mv(a) for a in t]
            return t.to(device)
        kw = {f: mv(getattr(self, f)) for f in (
            "output", "x", "lora_a", "lora_b", "topk_weights", "topk_ids", "sorted_token_ids",
            "expert_ids", "num_tokens_post_padded", "token_lora_mapping", "lora_ids",
            "adapter_enabled", "expert_map")}
        return OpInputs(case=self.case, num_active_loras=self.num_active_loras, **kw)


def expert_map_for(E: int, ep_size: int, ep_rank: int, device="cpu") -> torch.Tensor:
    """Linear EP split: global expert -> local id on this rank, -1 elsewhere."""
    local = E // ep_size
    m = torch.full((E,), -1, dtype=torch.int32, device=device)
    m[ep_rank * local:(ep_rank + 1) * local] = torch.arange(local, dtype=torch.int32, device=device)
    return m


def build_op_inputs(case: Case, device="cpu") -> OpInputs:
    """Tensors for an op-level case on `device` (drawn there when it is a CUDA device: `build_device`); the align
    (sorted layout) is the reference's, exact. num_active_loras stays on the CPU, as in production."""
    probs = case.problems()
    if probs:
        raise ValueError(f"malformed case {case.to_json()}: " + "; ".join(probs))
    if case.level != "op":
        raise ValueError(f"build_op_inputs needs an op-level case, got level={case.level!r}")
    if case.view:   # the plain case's inputs, seen through the view (harness.build.properties)
        from moe_lora_harness.harness.build.properties import view_inputs
        return dataclasses.replace(view_inputs(build_op_inputs(case.replace(view=""), device), case.view), case=case)
    dt = torch_dtype(case)
    at = build_device(device)
    T, k = case.T, case.top_k
    w, ids = make_routing(case, _gen(case, 1, at))
    mapping = make_token_lora_mapping(case, _gen(case, 2, at))
    enabled = adapter_enabled_for(case, at)
    A, B = make_lora_stack(case, _gen(case, 3, at), num_slices=case.num_slices, K=case.K, N=case.N,
                           E_local=case.local_experts, dtype=dt)
    g = _gen(case, 4, at)
    rows = T * k if case.mul_routed_weight else T
    x = with_negative_zeros(case, scale_inputs(case, torch.randn(rows, case.K, generator=g, device=at),
                                               k if case.mul_routed_weight else 1).to(dt), 6)
    # the buffer's prior values at the inputs' scale, so the delta stays about as large as what it is added to
    # (with add_inputs and subnormal inputs, the sum is subnormal too: where a flush-to-zero kernel shows)
    output = with_negative_zeros(case, scale_prior(case, torch.randn(T, k, case.width, generator=g, device=at)).to(dt),
                                 7)
    lora_ids = ref_align.active_lora_ids(mapping, case.max_loras)
    n_active = case.max_loras + 1 if case.active_loras == "all" else int(torch.unique(mapping).numel())
    num_active = torch.tensor([n_active], dtype=torch.int32)
    expert_map = expert_map_for(case.E, case.ep_size, case.ep_rank, at) if case.ep_size > 1 else None
    if case.layout == "naive":
        sorted_ids = ntpp = None
        expert_ids = ids.reshape(-1).clone()
    else:
        sorted_ids, expert_ids, ntpp = ref_align.align_alloc(
            ids, case.block_size_m, case.local_experts, case.max_loras, expert_map=expert_map)
        max_pad, max_blocks = sorted_ids.shape[1], expert_ids.shape[1]
        ref_align.moe_lora_align_block_size(
            ids, mapping, case.E if expert_map is not None else case.local_experts, case.block_size_m,
            case.max_loras, max_pad, max_blocks, sorted_ids, expert_ids, ntpp, enabled, lora_ids,
            expert_map)
    inp = OpInputs(case=case, output=output, x=x, lora_a=A, lora_b=B, topk_weights=w, topk_ids=ids,
                   sorted_token_ids=sorted_ids, expert_ids=expert_ids, num_tokens_post_padded=ntpp,
                   token_lora_mapping=mapping, lora_ids=lora_ids, num_active_loras=num_active,
                   adapter_enabled=enabled, expert_map=expert_map)
    return inp if torch.device(device) == at else inp.to(device)


@dataclass
class ExpertInputs:
    """Tensors of an expert-level case; `call()` gives the backend's `ExpertCall` (output NaN-poisoned)."""

    case: Case
    hidden: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    stacked: object            # reference.adapters.StackedMoELoRA or None
    token_lora_mapping: torch.Tensor
    expert_map: torch.Tensor | None
    quantized: tuple = ()      # (w13_q, w13_scales, w2_q, w2_scales) when case.quant != "none"

    def call(self, device):
        from moe_lora_harness.harness.spec.contract import ExpertCall
        c = self.case
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        lst = lambda ts: None if ts is None else [t.to(device) for t in ts]  # noqa: E731
        s = self.stacked
        out = torch.full((self.hidden.shape[0], c.H), float("nan"), dtype=self.hidden.dtype, device=device)
        return ExpertCall(
            output=out, hidden_states=mv(self.hidden), w13=mv(self.w13), w2=mv(self.w2),
            topk_weights=mv(self.topk_weights), topk_ids=mv(self.topk_ids), activation=c.activation,
            w13_bias=mv(self.w13_bias), w2_bias=mv(self.w2_bias),
            w13_lora_a=lst(s.w13_a) if s else None, w13_lora_b=lst(s.w13_b) if s else None,
            w2_lora_a=lst(s.w2_a) if s else None, w2_lora_b=lst(s.w2_b) if s else None,
            adapter_enabled=mv(s.adapter_enabled) if s else None,
            token_lora_mapping=mv(self.token_lora_mapping), max_loras=c.max_loras,
            expert_map=mv(self.expert_map), apply_router_weight_on_input=c.apply_router_weight_on_input,
            quant=c.quant, **({} if not self.quantized else dict(zip(
                ("w13_q", "w13_scales", "w2_q", "w2_scales"), [mv(t) for t in self.quantized]))))


def expert_weights(g: torch.Generator, E: int, N: int, K: int, dtype: torch.dtype, *, per_expert: bool) -> torch.Tensor:
    """(E, N, K) base weights randn / sqrt(K) in `dtype`, on g's device. `per_expert`: drawn one expert at a time,
    so only one expert ever exists in float64 (a CUDA build: a DeepSeek-V3 layer's w13 in one float64 draw is 60
    GB); else in one draw, the values the CPU has always given (a split draw gives other values)."""
    dev = g.device
    if not per_expert:
        return (torch.randn(E, N, K, generator=g, dtype=torch.float64, device=dev) / math.sqrt(K)).to(dtype)
    w = torch.empty(E, N, K, dtype=dtype, device=dev)
    for e in range(E):
        w[e] = torch.randn(N, K, generator=g, dtype=torch.float64, device=dev) / math.sqrt(K)
    return w


def file_adapters(case: Case, local_experts: int, gated: bool) -> list:
    """The ExpertAdapters of `case.adapters` (PEFT folders, decoder layer `case.adapter_layer`), cut to this EP
    rank's experts; each must have the rank `case.ranks` gives its slot. GPT-OSS (swigluoai) files interleave
    gate and up rows, as transformers stores them."""
    if not case.adapters:
        return []
    from moe_lora_harness.harness.served.peft_adapters import read_adapter
    lo = case.ep_rank * local_experts if case.ep_size > 1 else 0
    out = []
    for slot, path in enumerate(case.adapters):
        ad = read_adapter(path, num_experts=case.E, hidden_size=case.H, intermediate_size=case.I, gated=gated,
                          layer=case.adapter_layer, interleaved=case.activation == "swigluoai")
        if ad.rank != case.ranks[slot]:
            raise ValueError(f"adapters[{slot}] ({path}) has rank {ad.rank}, but the case's ranks[{slot}] is "
                             f"{case.ranks[slot]}")
        cut = {f.name: (v[lo:lo + local_experts] if isinstance(v, torch.Tensor) else v)
               for f in dataclasses.fields(ad) for v in [getattr(ad, f.name)]}
        out.append(type(ad)(**cut))
    return out


def _block_magnitudes(w: torch.Tensor, g: torch.Generator, block: int = 128) -> torch.Tensor:
    """w (E, N, K) with each 128 x 128 block scaled by its own factor in [1/e, e] (drawn from g), one expert at a
    time in float64 (as expert_weights: a whole layer in float64 would not fit a GPU)."""
    E, N, K = w.shape
    f = torch.exp(torch.rand(E, N // block, K // block, generator=g, dtype=torch.float64, device=w.device) * 2 - 1)
    out = torch.empty_like(w)
    for e in range(E):
        out[e] = w[e].to(torch.float64) * f[e].repeat_interleave(block, 0).repeat_interleave(block, 1)
    return out


def build_expert_inputs(case: Case, device="cpu") -> ExpertInputs:
    """Tensors for an expert-level case (base weights, biases, routing, packed LoRA), on `build_device(device)`:
    drawn on a CUDA device, else on the CPU (`call(device)` moves them)."""
    from moe_lora_harness.reference.activations import is_gated
    from moe_lora_harness.reference.adapters import ExpertAdapter, pack_moe_lora
    probs = case.problems()
    if probs:
        raise ValueError(f"malformed case {case.to_json()}: " + "; ".join(probs))
    if case.level != "expert":
        raise ValueError(f"build_expert_inputs needs an expert-level case, got level={case.level!r}")
    if case.view:   # the plain case's inputs, seen through the view (harness.build.properties)
        from moe_lora_harness.harness.build.properties import view_inputs
        return dataclasses.replace(view_inputs(build_expert_inputs(case.replace(view=""), device), case.view,
                                               in_place=True),
                                   case=case)
    dt = torch_dtype(case)
    at = build_device(device)
    per_expert = at.type == "cuda"
    gated = is_gated(case.activation)
    T, H, I, k = case.T, case.H, case.I, case.top_k
    El = case.E if case.dispatched else case.local_experts   # dispatched EP: the global layer (ranks slice it)
    N1 = 2 * I if gated else I
    g = _gen(case, 11, at)
    hidden = with_negative_zeros(case, scale_inputs(case, torch.randn(T, H, generator=g, device=at)).to(dt), 13)
    w13 = expert_weights(g, El, N1, H, dt, per_expert=per_expert)
    w2 = expert_weights(g, El, H, I, dt, per_expert=per_expert)
    quantized = ()
    if case.quant == "fp8_block":   # blocks of unequal magnitude, as a checkpoint's are (a wrong block scale shows)
        w13, w2 = (_block_magnitudes(w, _gen(case, 14, at)) for w in (w13, w2))
    if case.quant != "none":   # snap to the quantization grid; the reference uses the dequantized weights
        from moe_lora_harness.reference.quant import dequantize, quantize   # FP8: e4m3 codes, fp32 scales (fp8.py)
        q13, s13 = quantize(w13, case.quant, dt)
        q2, s2 = quantize(w2, case.quant, dt)
        w13, w2 = dequantize(q13, s13, case.quant, dt), dequantize(q2, s2, case.quant, dt)
        quantized = (q13, s13, q2, s2)
    b13 = (0.5 * torch.randn(El, N1, generator=g, device=at)).to(dt) if case.bias else None
    b2 = (0.5 * torch.randn(El, H, generator=g, device=at)).to(dt) if case.bias else None
    w, ids = make_routing(case, _gen(case, 1, at))
    mapping = make_token_lora_mapping(case, _gen(case, 2, at))
    expert_map = (expert_map_for(case.E, case.ep_size, case.ep_rank, at)
                  if case.ep_size > 1 and not case.dispatched else None)
    stacked = None
    if case.lora:
        ga = _gen(case, 12, at)
        adapters = [None if r == 0 else ExpertAdapter.random(El, H, I, r, gated, scaling=ADAPTER_SCALING, generator=ga,
                                                             device=at)
                    for r in case.slot_ranks[len(case.adapters):]]
        adapters = [*file_adapters(case, El, gated), *adapters]
        stacked = pack_moe_lora(adapters, max_loras=case.max_loras, max_rank=case.max_rank, num_experts=El,
                                hidden_size=H, intermediate_size=I, dtype=dt, gated=gated,
                                shared_a=case.shared_a, shared_b=case.shared_b, device=at)
        del adapters
        if case.mapping == "disabled":
            stacked.adapter_enabled[0] = 0
    return ExpertInputs(case, hidden, w13, w2, b13, b2, w, ids, stacked, mapping, expert_map, quantized)
