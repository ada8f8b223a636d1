"""Our Triton FP8 experts (issue 22 item 3): the e4m3 activation quantizer bit for bit against the reference's, the
FP8 grouped GEMM's argument checks, and every LoRA path (small-batch, one-shot, two-kernel, dual stream) judged
under both schemes. On the CPU they run in Triton's interpreter (fp16: it cannot compute bf16); on a GPU in bf16
and fp16 at larger shapes."""
from __future__ import annotations

import pytest
import torch

from moe_lora_harness.backends import dual_stream, experts
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.execution.runner import run_case
from moe_lora_harness.kernels.experts.gated_fast_experts import GatedFastExperts
from moe_lora_harness.kernels.experts.triton_experts import TritonExperts
from moe_lora_harness.kernels.fp8_schemes import FP8_SCHEMES
from moe_lora_harness.kernels.triton.fp8_quant import quantize_activation
from moe_lora_harness.kernels.triton.fused_moe_gemm import fused_moe_gemm
from moe_lora_harness.kernels.triton.grouped_gemm import grouped_gemm
from moe_lora_harness.kernels.triton.moe_align import moe_align_block_size
from moe_lora_harness.kernels.triton.quant_gemm import pack_weights
from moe_lora_harness.reference import fp8 as ref_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = ("bfloat16", "float16") if DEVICE == "cuda" else ("float16",)   # the interpreter has no bf16
F64 = torch.float64


def _hard_values(n_rows: int, K: int, dt: torch.dtype) -> torch.Tensor:
    """Rows spanning 2^-20 .. 2^12 in magnitude (subnormal codes, saturation's neighbourhood), a zero row, a row
    whose x / s lands just below powers of two (the round-up carry) and on ties between e4m3 values."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n_rows, K, generator=g, dtype=F64) * torch.logspace(-6, 3.6, n_rows, dtype=F64).unsqueeze(1)
    x[0] = 0
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(F64)
    grid = torch.unique(grid[torch.isfinite(grid) & (grid > 0)])
    tie_and_carry = torch.cat([(grid[1:] + grid[:-1]) / 2, grid[1:] * (1 - 2.0 ** -7)])
    x[1, :K] = tie_and_carry[torch.randint(0, tie_and_carry.numel(), (K,), generator=g)] / 448
    x[1, 0] = 1.0 / 448 * 448          # amax 1: scale 1/448 exactly in the grid's units
    return x.to(dt)


@pytest.mark.parametrize("scheme", sorted(FP8_SCHEMES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_quantizer_is_the_references_bit_for_bit(scheme, dtype):
    dt = getattr(torch, dtype)
    x = _hard_values(12, 256, dt)
    codes, scales = quantize_activation(x.to(DEVICE), scheme)
    q, s = ref_fp8.quantize_activation(x, scheme)
    group = 256 if FP8_SCHEMES[scheme][0] is None else FP8_SCHEMES[scheme][0]
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert torch.equal(scales.cpu().to(F64).repeat_interleave(group, 1), s)
    assert torch.equal(codes.cpu().to(F64), q)


def test_quantizer_rejects_bad_input_by_name():
    with pytest.raises(ValueError, match="scheme must be one of"):
        quantize_activation(torch.zeros(2, 128, dtype=torch.float16), "fp8_tensor")
    with pytest.raises(ValueError, match="divisible by 128"):
        quantize_activation(torch.zeros(2, 96, dtype=torch.float16), "fp8_block")
    with pytest.raises(TypeError, match="x must be float16"):
        quantize_activation(torch.zeros(2, 128, dtype=torch.int32), "fp8_w8a8")


def _fp8_gemm_inputs(scheme: str):
    E, N, K, T, k = 2, 128, 128, 3, 2
    w = torch.randn(E, N, K, generator=torch.Generator().manual_seed(3), dtype=F64) / 8
    qw = pack_weights(*(t.to(DEVICE) for t in ref_fp8.quantize_weights(w, scheme)), scheme)
    topk = torch.tensor([[0, 1], [1, 0], [0, 1]], dtype=torch.int32, device=DEVICE)
    ids, eids, ntpp = moe_align_block_size(topk, 16, E, None)
    x = torch.randn(T, K, dtype=torch.float16).to(DEVICE)
    return qw, x, (ids, eids, ntpp), T * k, N, k


def test_fp8_gemm_rejects_wrong_activations_and_scales_by_name():
    qw, x, (ids, eids, ntpp), P, N, k = _fp8_gemm_inputs("fp8_block")
    out = torch.empty(P, N, dtype=torch.float16, device=DEVICE)
    codes, scales = quantize_activation(x, "fp8_block")
    kw = dict(sorted_token_ids=ids, expert_ids=eids, num_tokens_post_padded=ntpp, top_k=k, x_row_div=k,
              block_m=16, quant=qw)
    with pytest.raises(TypeError, match="x must hold float8_e4m3fn codes"):
        fused_moe_gemm(out, x, None, x_scales=scales, **kw)
    with pytest.raises(ValueError, match=r"x_scales must be a float32 tensor \(3, 1\)"):
        fused_moe_gemm(out, codes, None, x_scales=scales.to(torch.float16), **kw)
    with pytest.raises(ValueError, match="x_scales must be"):
        fused_moe_gemm(out, codes, None, x_scales=None, **kw)
    with pytest.raises(TypeError, match="FP8 weights need out in float16 or bfloat16"):
        fused_moe_gemm(out.float(), codes, None, x_scales=scales, **kw)
    with pytest.raises(ValueError, match="x_scales is for FP8 weights only"):
        fused_moe_gemm(out, x, torch.zeros(2, N, 128, dtype=torch.float16, device=DEVICE), x_scales=scales,
                       **dict(kw, quant=None))
    with pytest.raises(ValueError, match="grouped_gemm takes no FP8 weights"):
        grouped_gemm(out, x, None, torch.arange(P, dtype=torch.int32, device=DEVICE),
                     torch.tensor([0, 3, 6], dtype=torch.int32, device=DEVICE), x_row_div=k, quant=qw)


def test_fp8_weights_are_checked_at_packing_by_name():
    w = torch.randn(2, 128, 128, dtype=F64)
    codes, scales = ref_fp8.quantize_weights(w, "fp8_block")
    with pytest.raises(ValueError, match=r"scales for fp8_block must have shape \(2, 1, 1\)"):
        pack_weights(codes, scales[:, :, :1].expand(2, 1, 1).reshape(2, 1).contiguous(), "fp8_block")
    with pytest.raises(ValueError, match="must be finite and > 0"):
        pack_weights(codes, -scales, "fp8_block")
    with pytest.raises(TypeError, match="q must be a float8_e4m3fn"):
        pack_weights(codes.to(torch.float16), scales, "fp8_block")
    with pytest.raises(ValueError, match="divisible by 128"):
        pack_weights(codes[:, :64], scales, "fp8_block")


# -- every LoRA path under FP8, judged ------------------------------------------------------------------------

def _sizes(scheme: str) -> dict:
    """Per scheme and device: fp8_block needs H, I % 128; the GPU takes the larger of each."""
    if DEVICE == "cuda":
        return dict(H=512, I=384 if scheme == "fp8_w8a8" else 256, E=16, top_k=4)
    return dict(H=64 if scheme == "fp8_w8a8" else 128, I=48 if scheme == "fp8_w8a8" else 128, E=4, top_k=2)


# path -> Case fields that make the mixin take it (asserted below, so a heuristic change cannot hide a path)
PATHS = {
    "small_batch": lambda s: dict(T=2, E=4 * s["top_k"], max_loras=4),    # naive layout: T*k*8 <= E*L
    "one_shot": lambda s: dict(T=64 if DEVICE == "cuda" else 16),
    "two_kernel": lambda s: dict(T=64 if DEVICE == "cuda" else 16, max_rank=136),   # rank past one-shot's 128
}
SPECS = {"triton_experts": (experts.TRITON_EXPERTS, TritonExperts),
         "gated_fast_experts": (experts.GATED_FAST_EXPERTS, GatedFastExperts)}


def _case(scheme: str, path: str, dtype: str, seed: int) -> Case:
    s = _sizes(scheme)
    fields = dict(level="expert", quant=scheme, dtype=dtype, max_rank=8, max_loras=3, seed=seed, outliers=1, **s)
    fields.update(PATHS[path](s))
    return Case(**fields)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("scheme", sorted(FP8_SCHEMES))
def test_every_lora_path_passes_under_fp8(scheme, path, dtype):
    case = _case(scheme, path, dtype, seed=11)
    names = ["triton_experts"] + (["gated_fast_experts"] if case.I % 128 == 0 else [])
    for name in names:
        spec, cls = SPECS[name]
        assert experts.precision_for(cls)(case) == path, (name, case)
        out = run_case(spec, case, DEVICE)
        assert out.status == "pass", out.detail or out.reason


@pytest.mark.parametrize("scheme", sorted(FP8_SCHEMES))
def test_dual_stream_passes_under_fp8(scheme):
    case = _case(scheme, "one_shot", DTYPES[0], seed=12)
    assert dual_stream.gate_open(case)
    out = run_case(dual_stream.BACKEND, case, DEVICE)
    assert out.status == "pass", out.detail or out.reason


def test_classes_without_e4m3_operands_decline_fp8_with_the_reason():
    from moe_lora_harness.harness.spec.contract import support_for
    case = _case("fp8_w8a8", "one_shot", "float16", seed=13)
    for spec, c in ((experts.MARLIN_EXPERTS, case), (experts.OAI_EXPERTS, case.replace(activation="swigluoai"))):
        ok, why = support_for(spec, c, DEVICE)
        assert not ok and experts.FP8_DECLINE in why, (spec.name, why)
    assert support_for(experts.TRITON_EXPERTS, case, DEVICE)[0]
    assert support_for(experts.EXPERTS_ORACLE, case, "cuda")[0]      # the oracle picks a class that takes it
    ok, why = support_for(experts.TRITON_EXPERTS, case.replace(dtype="float32"), DEVICE)
    assert not ok
