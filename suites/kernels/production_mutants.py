"""Planted kernel bugs that only show at production size: our Triton experts with one defect each that is silent
at the sizes every other test uses (int32 offsets past 2^31 elements, a grid axis past 65535, a wrong tail past
4096 tokens, a split-K path taken only for a large K). Each is a BackendSpec with `triton_experts`' declarations;
`production-control` is the same path without a defect. PRODUCTION is the one table: each mutant's mechanism,
the smallest case it must fail (a catalogue model's layer, on a GPU), how it must fail, the case just below its
gate on that GPU and the small case it must pass under the CPU interpreter. docs/production-mutants.md.

  moe-lora-harness replay --backend moe_lora_harness.suites.kernels.production_mutants:BACKENDS --only NAME ...
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from moe_lora_harness.backends.experts import capabilities_of, precision_for, run_call
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.contract import BackendSpec, ExpertCall
from moe_lora_harness.harness.served.models import case_fields, model_named
from moe_lora_harness.harness.selftest.selftest import CORPORA
from moe_lora_harness.kernels.experts.triton_experts import TritonExperts
from moe_lora_harness.kernels.triton import fused_moe_gemm as gemm
from moe_lora_harness.kernels.triton.fused_moe_gemm import fused_moe_gemm
from moe_lora_harness.suites.kernels.source_mutants import Edit, installed, mutated

# why the corpus does not run on the CPU: selftest's production corpus says it (harness.selftest.selftest.CORPORA)
CPU_REASON = dict(next(c for c in CORPORA if c.name == "production").not_here)["cpu"]

CHUNK_TOKENS = 4096     # the chunked mutant's tokens per chunk (vLLM's fused MoE chunks its batch too)
TAIL_ROWS = 16          # ... and the block its defective last chunk is cut to
SPLIT_K_FROM = 4096     # the split-K mutant splits the base w13 GEMM over K = H from this H on ...
SPLITS = 2              # ... into this many chunks


# ----------------------------------------------------------------------------- the defects (built on first use)


@functools.cache
def _int32_offset():
    """The GEMM kernel with the expert id left int32, so `expert * stride_we` is an int32 product."""
    kernel = mutated(gemm._moe_gemm_kernel, [Edit("expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)",
                                                  "expert = tl.load(expert_ids_ptr + pid_m)")], tag="int32-offset")
    return ((gemm._moe_gemm_kernel, kernel),)


@functools.cache
def _grid_axis1():
    """The GEMM's one grid dimension (blocks x N tiles, ~T*top_k/BLOCK_M x N/BLOCK_N) launched on axis 1."""
    kernel = mutated(gemm._moe_gemm_kernel, [Edit("pid = tl.program_id(0)", "pid = tl.program_id(1)")],
                     tag="grid-axis1")
    launcher = mutated(gemm.launch_gemm, [Edit("grid = (triton.cdiv(EM, block_m) * triton.cdiv(N, cfg.block_n),)",
                                               "grid = (1, triton.cdiv(EM, block_m) * triton.cdiv(N, cfg.block_n))")],
                       uses={"_moe_gemm_kernel": kernel}, tag="grid-axis1")
    return ((gemm.launch_gemm, launcher),)


def _with(swaps: Callable[[], tuple]):
    """An experts entry point: triton_experts' path with `swaps()` installed for the call only."""
    def experts(call: ExpertCall) -> None:
        with installed(*swaps()):
            run_call(call, TritonExperts)
    return experts


def _rows(call: ExpertCall, lo: int, hi: int) -> ExpertCall:
    """The call restricted to tokens [lo, hi): every per-token tensor sliced (the output as a view)."""
    cut = {f: getattr(call, f)[lo:hi] for f in ("output", "hidden_states", "topk_weights", "topk_ids",
                                                 "token_lora_mapping") if getattr(call, f) is not None}
    return dataclasses.replace(call, **cut)


def _tail_dropped(call: ExpertCall) -> None:
    """triton_experts over chunks of CHUNK_TOKENS tokens; the last, partial chunk cut to whole TAIL_ROWS blocks, so
    its last T % TAIL_ROWS rows are never computed (dispatched EP runs whole: its ranks would disagree on chunks)."""
    T = int(call.hidden_states.shape[0])
    if call.ep_comm is not None or T <= CHUNK_TOKENS:
        run_call(call, TritonExperts)
        return
    for lo in range(0, T, CHUNK_TOKENS):
        hi = min(lo + CHUNK_TOKENS, T)
        if hi - lo < CHUNK_TOKENS:
            hi = lo + (hi - lo) // TAIL_ROWS * TAIL_ROWS
        if hi > lo:
            run_call(_rows(call, lo, hi), TritonExperts)


class _SplitKLostExperts(TritonExperts):
    """From K = H >= SPLIT_K_FROM the base w13 GEMM runs as SPLITS partial GEMMs over K chunks (the real kernel on
    views of x and w13), summed in fp32 and rounded once; the sum leaves out the last chunk's partial."""

    def base_w13(self, plan, x, out):
        K = plan.H
        if K < SPLIT_K_FROM:
            return super().base_w13(plan, x, out)
        ids, eids, ntpp = plan.align
        step = -(-K // SPLITS)
        total = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
        part = torch.empty_like(out)
        for i, lo in enumerate(range(0, K, step)):
            hi = min(lo + step, K)
            fused_moe_gemm(part, x[:, lo:hi], plan.w13[:, :, lo:hi], sorted_token_ids=ids, expert_ids=eids,
                           num_tokens_post_padded=ntpp, top_k=plan.k, x_row_div=plan.k, block_m=plan.block_m,
                           bias=plan.w13_bias if i == 0 else None)
            if hi < K:                       # the defect: the last chunk's partial is never added
                total += part.float()
        out.copy_(total)


# ----------------------------------------------------------------------------- the table


def model_case(model: str, **fields) -> Case:
    """A bf16 expert-level case of the catalogue model's layer (harness.served.models.case_fields) with `fields`."""
    return Case(**dict(dict(level="expert", dtype="bfloat16", seed=21), **case_fields(model_named(model)), **fields))


def _small(**fields) -> Case:
    """A CPU control: a small fp32 expert case the interpreter runs in seconds."""
    return Case(**dict(dict(level="expert", T=12, H=64, I=32, E=8, top_k=2, dtype="float32", seed=21), **fields))


# failure kinds of wrong values (runner.WRONG_VALUE_KINDS, and NaN / inf) -> any message
VALUES = {"element": "", "aggregate": "", "untouched": "", "nonfinite": ""}
# a read through a wrapped offset can leave the allocation: a CUDA memory fault, raised in the worker or killing it
MEMORY_FAULT = {"raised": r"illegal memory access|illegal address|misaligned address|unspecified launch failure",
                "crash": ""}


@dataclass(frozen=True)
class ProductionMutant:
    """One planted size-gated bug. On a GPU, `fails_on` (the smallest production case) must fail with a kind of
    `fails_as` ({kind: regex its message must match}) and `below_gate` (the same path just under the gate) must
    pass; under the CPU interpreter `passes_on` must pass and, where the interpreter can reach the gate in
    seconds, `cpu_fails_on` must fail as `fails_as` says. `swaps()`: the (original, mutated) functions installed
    for each call (None: a Python-level defect, `experts`)."""

    name: str
    mechanism: str
    gate: str
    model: str
    fails_on: Case
    fails_as: Mapping
    below_gate: Case
    passes_on: Case
    swaps: Callable | None = None
    experts: Callable | None = None
    cpu_fails_on: Case | None = None

    def entry(self) -> Callable:
        """The backend's experts entry point."""
        return self.experts or _with(self.swaps)


PRODUCTION = (
    ProductionMutant(
        "prod-int32-expert-offset",
        "fused-MoE GEMM: the expert's weight offset expert * stride computed in int32 (the int64 cast removed)",
        "E*N*K > 2^31 elements: from expert 2^31 / (N*K) on, the offset wraps (DeepSeek-V3 w13 256 x 4096 x 7168: "
        "expert 74)", "deepseek-v3",
        model_case("deepseek-v3", T=64), {**VALUES, **MEMORY_FAULT},
        model_case("qwen3-235b-a22b", T=64),     # 128 x 3072 x 4096 = 1.6e9 < 2^31
        _small(), swaps=_int32_offset),
    ProductionMutant(
        "prod-grid-axis1",
        "fused-MoE GEMM: its one grid dimension (align blocks x N tiles) launched on grid axis 1",
        "CUDA caps grid axes 1 and 2 at 65535: DeepSeek-V3's w2 GEMM needs 1278 x 56 = 71568 programs at T=16384, "
        "top_k 8 (42896 at T=8192)", "deepseek-v3",
        model_case("deepseek-v3", T=16384), {"raised": r"invalid argument|grid"},
        model_case("deepseek-v3", T=8192),
        _small(), swaps=_grid_axis1),
    ProductionMutant(
        "prod-tail-chunk-dropped",
        f"the experts run in chunks of {CHUNK_TOKENS} tokens; the last partial chunk is cut to whole {TAIL_ROWS}-row "
        f"blocks, so its last T % {TAIL_ROWS} rows are never computed",
        f"T > {CHUNK_TOKENS} with T % {TAIL_ROWS} != 0 (one chunk up to {CHUNK_TOKENS} tokens)", "qwen3-30b-a3b",
        model_case("qwen3-30b-a3b", T=CHUNK_TOKENS + 17), {"nonfinite": ""},
        model_case("qwen3-30b-a3b", T=CHUNK_TOKENS + TAIL_ROWS),    # chunked, and its tail whole: passes
        _small(T=40), experts=_tail_dropped,
        cpu_fails_on=_small(T=CHUNK_TOKENS + 17, H=16, I=16, E=2, top_k=1, lora=False)),
    ProductionMutant(
        "prod-split-k-lost",
        f"the base w13 GEMM split over K = H into {SPLITS} chunks from H >= {SPLIT_K_FROM} (partial GEMMs of the real "
        "kernel summed in fp32); the last chunk's partial is never added",
        f"H >= {SPLIT_K_FROM} (Qwen3-235B, Mixtral, DeepSeek-V3); below, the one-GEMM path", "qwen3-235b-a22b",
        model_case("qwen3-235b-a22b", T=256), {"element": "", "aggregate": ""},
        model_case("qwen3-30b-a3b", T=256),                         # H = 2048: one GEMM
        _small(), experts=lambda call: run_call(call, _SplitKLostExperts),
        cpu_fails_on=_small(T=4, H=SPLIT_K_FROM, I=16, E=2, max_loras=1)),
)

MUTANTS = {m.name: m for m in PRODUCTION}


def _spec(name: str, description: str, experts: Callable) -> BackendSpec:
    return BackendSpec(name=name, description=description, capabilities=capabilities_of(TritonExperts),
                       experts=experts, precision=precision_for(TritonExperts))


CONTROL = _spec("production-control", "no defect: triton_experts' path, as the mutants run it",
                lambda call: run_call(call, TritonExperts))
BACKENDS = [CONTROL] + [_spec(m.name, f"{m.mechanism} (fails when {m.gate})", m.entry()) for m in PRODUCTION]


def check_cases(name: str) -> list:
    """[(row label, case)] selftest's check detector runs for backend `name` (Corpus.cases): a mutant's production
    case; for the control, every mutant's."""
    rows = [(f"{m.name}: {m.model} T={m.fails_on.T}", m.fails_on) for m in PRODUCTION]
    return rows if name == CONTROL.name else [r for r, m in zip(rows, PRODUCTION) if m.name == name]
