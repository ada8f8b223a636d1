"""sm_90 code the hot Triton kernels compile to, checked on the CPU (no GPU, no timing).

Found on 2026-11-29: the one-shot kernel clamped its rank offsets (`where(rmask, offs_r, 0)`), which hid
their contiguity, so B's rank-contiguous tile loaded 2 bytes per instruction and the expand loop could not
pipeline it. The kernels were correct and every conformance test passed; only the H200 showed it (once
fixed, the one-shot path beat the two-kernel path at 60 of 60 shapes, up from 56). These tests compile the
kernels for sm_90 and fail if a 16-bit tile access moves under 16 bytes per thread or if a loop's tile
loads stop being asynchronous copies. All compiles run once, in one child process (sm90_codegen.py).
"""
from __future__ import annotations

import pytest

from .sm90_codegen import global_accesses, job, ttgir_sm90, unavailable_reason

UNAVAILABLE = unavailable_reason()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"sm_90 codegen: {UNAVAILABLE}")

LORA_UNIT_STRIDES = ("stride_xk", "stride_ak", "stride_br", "stride_on", "stride_cr")
EXPAND_STAGES = 3  # kernels.triton.one_shot.EXPAND_STAGES (not imported: the parent runs the interpreter)


def one_shot_meta(sub_m=32, block_r=64, rank=64, block_n=256, block_k=128, two=False):
    """Sorted-layout one-shot constexprs; the default tile sizes are all distinct so each tile is findable:
    x (sub_m, block_k), A (block_k, block_r), B (block_r, block_n), the output rows (sub_m, block_n)."""
    return dict(X_ROW_DIV=1, NAIVE=False, MUL_W=True, ADD_INPUTS=True, TWO_SLICES=two, SLICE_FROM_GRID=False,
                BLOCK_M=64, SUB_M=sub_m, BLOCK_R=block_r, RANK=rank, BLOCK_N=block_n, BLOCK_K=block_k,
                EVEN_K=True, IEEE=False, PREFETCH=False, SPLIT_K=1, EXPAND_STAGES=EXPAND_STAGES)


ONE_SHOT = {
    "rank 64": (one_shot_meta(), None),
    "rank 48 in a 64 tile": (one_shot_meta(rank=48), None),
    "rank 16, two slices, capped": (one_shot_meta(block_r=16, rank=16, two=True), 168),
}
JOBS = {
    **{f"one_shot {name}": job("moe_lora_harness.kernels.triton.one_shot:_one_shot_kernel", meta, unit_strides=LORA_UNIT_STRIDES,
                               maxnreg=cap) for name, (meta, cap) in ONE_SHOT.items()},
    "small_batch": job("moe_lora_harness.kernels.triton.small_batch:_small_batch_kernel",
                       dict(X_ROW_DIV=1, MUL_W=True, ADD_INPUTS=True, BLOCK_R=64, RANK=64, BLOCK_N=64, BLOCK_K=256,
                            EVEN_K=True), unit_strides=LORA_UNIT_STRIDES),
    "two_kernel shrink": job("moe_lora_harness.kernels.triton.two_kernel:_shrink_kernel",
                             dict(X_ROW_DIV=1, NAIVE=False, BLOCK_M=64, SUB_M=64, BLOCK_R=64, BLOCK_K=128, EVEN_K=True,
                                  IEEE=False), unit_strides=LORA_UNIT_STRIDES),
    "two_kernel expand": job("moe_lora_harness.kernels.triton.two_kernel:_expand_kernel",
                             dict(NAIVE=False, MUL_W=True, ADD_INPUTS=True, BLOCK_M=64, SUB_M=64, BLOCK_N=128,
                                  BLOCK_KR=64, IEEE=False), unit_strides=LORA_UNIT_STRIDES),
    "fused_moe_gemm": job("moe_lora_harness.kernels.triton.fused_moe_gemm:_moe_gemm_kernel",
                          dict(X_ROW_DIV=1, USE_PERM=False, X_BY_SLOT=False, HAS_BIAS=False, MUL_W=False, QUANT=False,
                               BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, EVEN_K=True, IEEE=False),
                          unit_strides=("stride_xk", "stride_wk", "stride_on"), pointer_types={"w_ptr": "*bf16"}),
    **{f"probe clamp={clamp}": job("moe_lora_harness.suites.kernels.sm90_codegen:rank_offset_probe",
                                   dict(RANK=64, BLOCK_R=64, BLOCK_N=128, CLAMP=clamp), unit_strides=("stride_br", "stride_on"))
       for clamp in (False, True)},
}


@pytest.fixture(scope="module")
def accesses():
    return {name: global_accesses(ir) for name, ir in ttgir_sm90(JOBS).items()}


def narrow(acc) -> list:
    """The 16-bit tile accesses that move fewer than 16 bytes per thread instruction."""
    return [a for a in acc if a.dtype in ("bf16", "f16") and a.vector_bytes < 16]


def async_shapes(acc) -> set:
    return {a.shape for a in acc if a.op == "async_copy"}


@pytest.mark.parametrize("name", list(ONE_SHOT))
def test_one_shot_tiles_are_vectorized_and_the_expand_loop_pipelined(name, accesses):
    meta = ONE_SHOT[name][0]
    acc = accesses[f"one_shot {name}"]
    assert not narrow(acc), f"{name}: tile accesses under 16 bytes per thread: {narrow(acc)}"
    tiles = {"x": (meta["SUB_M"], meta["BLOCK_K"]), "A": (meta["BLOCK_K"], meta["BLOCK_R"]),
             "B": (meta["BLOCK_R"], meta["BLOCK_N"]), "previous output": (meta["SUB_M"], meta["BLOCK_N"])}
    missing = [t for t, shape in tiles.items() if shape not in async_shapes(acc)]
    assert not missing, f"{name}: not software-pipelined (no async copy): {missing}; copies: {async_shapes(acc)}"


def test_small_batch_tiles_are_vectorized(accesses):
    acc = accesses["small_batch"]
    assert len(acc) >= 2 and not narrow(acc), acc


@pytest.mark.parametrize("name", ["two_kernel shrink", "two_kernel expand"])
def test_two_kernel_tiles_are_vectorized_and_pipelined(name, accesses):
    acc = accesses[name]
    assert not narrow(acc), narrow(acc)
    assert len(async_shapes(acc)) >= 2, acc


def test_fused_moe_gemm_tiles_are_vectorized_and_pipelined(accesses):
    acc = accesses["fused_moe_gemm"]
    assert not narrow(acc), narrow(acc)
    assert {(32, 64), (64, 128)} <= async_shapes(acc), acc  # x (BLOCK_M, BLOCK_K), w (BLOCK_K, BLOCK_N)


def _fp32_one_shot(prefetch: bool, mul_w: bool) -> dict:
    """A naive-layout fp32 one-shot compile whose tiles have distinct shapes: A (32, 16), B (16, 64)."""
    meta = dict(X_ROW_DIV=1, NAIVE=True, MUL_W=mul_w, ADD_INPUTS=True, TWO_SLICES=True, SLICE_FROM_GRID=False,
                BLOCK_M=16, SUB_M=16, BLOCK_R=16, RANK=16, BLOCK_N=64, BLOCK_K=32, EVEN_K=False, IEEE=True,
                PREFETCH=prefetch, SPLIT_K=1, EXPAND_STAGES=None)
    return job("moe_lora_harness.kernels.triton.one_shot:_one_shot_kernel", meta, unit_strides=LORA_UNIT_STRIDES,
               elem="fp32")


@pytest.fixture(scope="module")
def fp32_one_shot_ir():
    return ttgir_sm90({f"prefetch={p} mul_w={m}": _fp32_one_shot(p, m) for p in (False, True) for m in (False, True)})


def expand_accumulators(ir: str) -> list:
    """The accumulator operand of each expand dot (B's (16, 64) tile its second operand), and what defines it."""
    import re
    defs = dict(re.findall(r"^\s*(%[\w.]+) = (\S+)", ir, re.M))
    found = re.findall(r"tt\.dot %[\w.]+, %[\w.]+, (%[\w.]+)[^\n]*\* tensor<16x64xf32", ir)
    return [(acc, defs.get(acc, "?")) for acc in found]


def test_fp32_one_shot_sums_the_delta_apart_from_the_output(fp32_one_shot_ir):
    """The one-shot rounding model adds the delta, summed over the rank, to the output once. Triton's combiner turns
    `prev + dot(u, B)` into a dot accumulating from prev, which in fp32 (no cast between) rounds every rank step at
    the output's scale: an H100 run failed the judge by 1.7 times its per-element bound so (fiftieth session). Every
    expand dot must start from a constant zero."""
    for name, ir in fp32_one_shot_ir.items():
        accs = expand_accumulators(ir)
        assert len(accs) == 2, (name, accs)       # the two slices' expands
        assert all(op == "arith.constant" for _, op in accs), (name, accs)


def test_the_check_catches_a_clamped_rank_offset(accesses):
    """The check itself: the probe kernel's B load is 16 bytes wide, and 2 bytes once its offsets are clamped."""
    plain = [a for a in accesses["probe clamp=False"] if a.op == "load"]
    clamped = [a for a in accesses["probe clamp=True"] if a.op == "load"]
    assert plain and not narrow(plain), plain
    assert narrow(clamped), f"a clamped rank offset should load B 2 bytes at a time: {clamped}"
