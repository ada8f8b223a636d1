"""Triton base expert kernels (spec 5, 6, 8): align, fused-MoE GEMM, Marlin-style dequant GEMM, OAI-style
grouped GEMM with scatter-sum, and moe_sum, against float64 at the spec's rounding points.

How values are judged: every GEMM element is y = fp32 accumulation of x.W (+bias, *weight) rounded once
to dt. The float64 value v = w (x.W + b) and the standard forward-error bound of a fp32 dot product,
B = gamma_{K+2} |w| (|x|.|W| + |b|) with gamma_n = n u / (1 - n u) and u = 2^-23 (twice fp32's unit
roundoff, so any summation order and truncating accumulation are covered), give the only admissible
outputs: rnd(v - B) <= out <= rnd(v + B) (rounding is monotone). In fp16/bf16 that interval is a
single value for nearly every element, so the check is bit-exact where the arithmetic decides it;
test_interval_check_rejects_wrong_rounding_order shows it catches a misplaced rounding.
Rows the kernels must not write hold random sentinels and are compared bit for bit.
CPU: Triton interpreter (conftest sets TRITON_INTERPRET=1), fp16/fp32; CUDA (--device cuda): + bf16.
"""
from __future__ import annotations

import pytest
import torch

from moe_lora_harness.kernels.triton.fused_moe_gemm import GemmConfig, fused_moe_gemm
from moe_lora_harness.kernels.triton.grouped_gemm import grouped_gemm, permute_pairs, scatter_sum
from moe_lora_harness.kernels.triton.moe_align import moe_align_block_size
from moe_lora_harness.kernels.triton.moe_sum import moe_sum
from moe_lora_harness.kernels.triton.quant_gemm import pack_weights, unpack_weights
from moe_lora_harness.reference.precision import rnd
from moe_lora_harness.reference.quant import dequantize, quantize

U32 = 2.0 ** -23  # fp32 eps = 2 x unit roundoff


def gamma(n: int) -> float:
    """Higham's gamma_n for an n-term fp32 accumulation (u = fp32 eps, see the module docstring)."""
    return n * U32 / (1 - n * U32)


def dtypes(device: str) -> list:
    """fp16/fp32 everywhere; bf16 only on CUDA (the interpreter cannot do bf16 arithmetic)."""
    return [torch.float16, torch.float32] + ([torch.bfloat16] if device.startswith("cuda") else [])


def make_routing(g, T: int, k: int, G: int, E_local: int | None):
    """Distinct global ids per token; with E_local, an expert_map (G,) keeping E_local random experts."""
    rows = [torch.randperm(G, generator=g)[:k] for _ in range(T)]
    topk = (torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.long)).to(torch.int32)
    emap = None
    if E_local is not None:
        emap = torch.full((G,), -1, dtype=torch.int32)
        emap[torch.randperm(G, generator=g)[:E_local]] = torch.arange(E_local, dtype=torch.int32)
    return topk, emap


def local_ids(topk, emap, E: int) -> torch.Tensor:
    """Flat (T*k,) local expert per pair, -1 where the pair is not computed here."""
    flat = topk.reshape(-1).long()
    if emap is not None:
        flat = torch.where(flat >= 0, emap.long()[flat.clamp(min=0)], -1)
    return torch.where((flat >= 0) & (flat < E), flat, -1)


def gemm_truth(x, w, rows, experts, bias=None, weights=None):
    """(value, bound) float64 (n, N) for out rows: v = wt * (x[rows] . W[e]^T + b[e]); bound B of the docstring."""
    xr = x.double()[rows]
    W = w.double()[experts]
    v = torch.einsum("nk,nck->nc", xr, W)
    s = torch.einsum("nk,nck->nc", xr.abs(), W.abs())
    if bias is not None:
        v = v + bias.double()[experts]
        s = s + bias.double()[experts].abs()
    if weights is not None:
        v = v * weights.double()[:, None]
        s = s * weights.double().abs()[:, None]
    return v, gamma(x.shape[1] + 2) * s


def assert_in_interval(out, value, bound, dt, what: str) -> None:
    """rnd(v - B) <= out <= rnd(v + B) elementwise (see the module docstring)."""
    o = out.double().cpu()
    lo, hi = rnd(value - bound, dt), rnd(value + bound, dt)
    bad = ~((o >= lo) & (o <= hi))
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())}/{bad.numel()} elements outside the admissible interval; first at "
        f"{bad.nonzero()[0].tolist()}: got {o[bad][0].item()!r}, allowed [{lo[bad][0].item()!r}, {hi[bad][0].item()!r}]"
    )


def rand(g, *shape, scale=1.0):
    """Standard normal float32 values times `scale` (non-trivial inputs, never zeros)."""
    return torch.randn(*shape, generator=g) * scale


# ----------------------------------------------------------------------------------------------- align


@pytest.mark.parametrize("T,k,bs,with_map", [(0, 2, 16, False), (1, 1, 16, False), (5, 3, 16, True), (8, 2, 32, True)])
def test_moe_align_buckets_every_local_pair_once(device, T, k, bs, with_map):
    g = torch.Generator().manual_seed(T * 7 + k)
    G, E = 10, (4 if with_map else 10)
    topk, emap = make_routing(g, T, k, G, E if with_map else None)
    if T >= 5:
        topk[1, 0] = -1  # a padding pair (id -1) is dropped too
    s, e, n = moe_align_block_size(topk.to(device), bs, E, None if emap is None else emap.to(device))
    s, e, n = s.cpu(), e.cpu(), n.cpu()
    assert s.dtype == e.dtype == n.dtype == torch.int32 and n.shape == (1,)
    P = T * k
    loc = local_ids(topk, emap, E)
    counts = torch.bincount(loc[loc >= 0], minlength=E)
    total = int(((counts + bs - 1) // bs * bs).sum())
    assert int(n) == total and s.numel() % bs == 0 and e.numel() == s.numel() // bs and s.numel() >= total
    nb = total // bs
    assert bool((e[nb:] == -1).all()) and bool((e[:nb] >= 0).all()), "blocks past the end must be -1, none before"
    assert bool((s[total:] == P).all()), "slots past the end must hold the pad value T*k"
    seen = []
    for b in range(nb):
        ids = s[b * bs:(b + 1) * bs]
        real = ids[ids != P].long()
        assert real.numel() > 0 and bool((loc[real] == e[b]).all()), f"block {b} mixes experts"
        seen += real.tolist()
    assert sorted(seen) == (loc >= 0).nonzero().squeeze(1).tolist(), "each local pair exactly once, no other"


# --------------------------------------------------------------------------------------- fused MoE GEMM


def gemm_case(device, dt, *, T=6, k=2, G=8, E=4, K=72, N=40, seed=0, gemm2=False, with_map=True):
    """Random inputs for GEMM1 (x (T, K), row p // k) or GEMM2 (x (T*k, K), row p, routing weight)."""
    g = torch.Generator().manual_seed(seed)
    topk, emap = make_routing(g, T, k, G if with_map else E, E if with_map else None)
    x = rand(g, T * k if gemm2 else T, K).to(dt)
    w = rand(g, E, N, K, scale=K ** -0.5).to(dt)
    bias = rand(g, E, N, scale=0.5).to(dt)
    tw = torch.rand(T, k, generator=g) + 0.1
    out0 = rand(g, T * k, N).to(dt)  # sentinel values the kernel must leave alone on uncovered rows
    d = {n: (t.to(device) if t is not None else None) for n, t in
         dict(topk=topk, emap=emap, x=x, w=w, bias=bias, tw=tw, out0=out0).items()}
    d["loc"] = local_ids(topk, emap, E)
    return d


def check_gemm(c, out, dt, *, gemm2: bool, k: int, w=None, what=""):
    """Covered rows inside the interval of the float64 value; uncovered rows bit-identical to the sentinel."""
    loc = c["loc"]
    rows = (loc >= 0).nonzero().squeeze(1)
    assert rows.numel() > 0 and rows.numel() < loc.numel(), "case must have both computed and non-local pairs"
    o, out0 = out.cpu(), c["out0"].cpu()
    xrows = rows if gemm2 else rows // k
    v, b = gemm_truth(c["x"].cpu(), (w if w is not None else c["w"]).cpu(), xrows, loc[rows], c["bias"].cpu(),
                      c["tw"].cpu().reshape(-1)[rows] if gemm2 else None)
    assert_in_interval(o[rows], v, b, dt, what)
    untouched = loc < 0
    assert torch.equal(o[untouched], out0[untouched]), f"{what}: a non-local pair's row was written"


@pytest.mark.parametrize("gemm2", [False, True], ids=["gemm1", "gemm2"])
def test_fused_moe_gemm_matches_float64(device, gemm2):
    """GEMM1: x (T, K), bias, no weight. GEMM2: x (T*k, K), bias then fp32 routing weight, one rounding.
    K=72, N=40 are no multiples of the tiles; expert_map drops non-local pairs; a small-tile config too."""
    k, E, bm = 2, 4, 16
    for dt in dtypes(device):
        for cfg in (None, GemmConfig(block_n=16, block_k=32, group_m=2)):
            c = gemm_case(device, dt, k=k, E=E, seed=1 + gemm2, gemm2=gemm2)
            s, e, n = moe_align_block_size(c["topk"], bm, E, c["emap"])
            out = c["out0"].clone()
            fused_moe_gemm(out, c["x"], c["w"], s, e, n, top_k=k, x_row_div=1 if gemm2 else k, bias=c["bias"],
                           topk_weights=c["tw"], mul_routed_weight=gemm2, block_m=bm, config=cfg)
            check_gemm(c, out, dt, gemm2=gemm2, k=k, what=f"{dt} gemm2={gemm2} cfg={cfg}")


def test_fused_moe_gemm_zero_tokens_and_no_bias(device):
    dt = torch.float16
    w = torch.randn(3, 32, 48).to(dt).to(device)
    topk = torch.zeros(0, 2, dtype=torch.int32, device=device)
    s, e, n = moe_align_block_size(topk, 16, 3)
    out = torch.empty(0, 32, dtype=dt, device=device)
    fused_moe_gemm(out, torch.empty(0, 48, dtype=dt, device=device), w, s, e, n, top_k=2, x_row_div=2, block_m=16)
    # no bias, every expert local, block 32
    c = gemm_case(device, dt, T=5, k=3, E=3, K=48, N=32, seed=5, with_map=False)
    s, e, n = moe_align_block_size(c["topk"], 32, 3)
    out = c["out0"].clone()
    fused_moe_gemm(out, c["x"], c["w"], s, e, n, top_k=3, x_row_div=3, block_m=32)
    rows = torch.arange(15)
    v, b = gemm_truth(c["x"].cpu(), c["w"].cpu(), rows // 3, c["loc"])
    assert_in_interval(out.cpu(), v, b, dt, "no bias")


def test_interval_check_rejects_wrong_rounding_order():
    """The value check can fail: the weight applied AFTER rounding acc + bias (rnd(w * rnd(acc + b))),
    or the bias added after the weight, is rejected on a plain fp16 case."""
    g = torch.Generator().manual_seed(3)
    K, N, n = 64, 48, 12
    x, W = rand(g, n, K).half(), rand(g, 1, N, K, scale=K ** -0.5).half()
    bias, wt = rand(g, 1, N, scale=0.5).half(), torch.rand(n, generator=g) + 0.1
    e = torch.zeros(n, dtype=torch.long)
    v, b = gemm_truth(x, W, torch.arange(n), e, bias, wt)
    acc = x.float() @ W[0].float().t()
    good = ((acc + bias.float()) * wt[:, None]).half()
    assert_in_interval(good, v, b, torch.float16, "correct order")
    for bad in (((acc + bias.float()).half().float() * wt[:, None]).half(),
                (acc * wt[:, None] + bias.float()).half()):
        with pytest.raises(AssertionError, match="outside the admissible interval"):
            assert_in_interval(bad, v, b, torch.float16, "wrong order")
    # fp32: operands truncated to TF32 (tl.dot's default precision) instead of input_precision="ieee"
    x32, W32 = rand(g, n, K), rand(g, 1, N, K, scale=K ** -0.5)
    v, b = gemm_truth(x32, W32, torch.arange(n), e)
    assert_in_interval((x32.double() @ W32[0].double().t()).float(), v, b, torch.float32, "ieee")

    def tf32(t):
        return (t.view(torch.int32) & ~0x1FFF).view(torch.float32)
    with pytest.raises(AssertionError, match="outside the admissible interval"):
        assert_in_interval((tf32(x32).double() @ tf32(W32[0]).double().t()).float(), v, b, torch.float32, "tf32")


# ------------------------------------------------------------------------------------- quantized GEMM


@pytest.mark.parametrize("scheme", ["int4_g128", "int8_channel"])
def test_quant_pack_is_lossless_and_kernel_dequant_is_exact(device, scheme):
    """unpack(pack(q)) == q, and the GEMM's in-kernel dequant equals reference.quant.dequantize bit for bit:
    with one-hot x rows the output IS the dequantized weight (a single nonzero product, no rounding)."""
    g = torch.Generator().manual_seed(11)
    E, N, K = 2, 48, 256
    for dt in dtypes(device):
        q, sc = quantize(rand(g, E, N, K), scheme, dt)
        qw = pack_weights(q.to(device), sc.to(device), scheme)
        assert torch.equal(unpack_weights(qw).cpu(), q)
        assert qw.packed.numel() == (q.numel() // 2 if scheme == "int4_g128" else q.numel())
        T = E * K
        x = torch.eye(K, dtype=dt).repeat(E, 1).to(device)
        topk = (torch.arange(T) // K).to(torch.int32).view(T, 1).to(device)
        s, e, n = moe_align_block_size(topk, 64, E)
        out = torch.empty(T, N, dtype=dt, device=device)
        fused_moe_gemm(out, x, None, s, e, n, top_k=1, x_row_div=1, block_m=64, quant=qw)
        want = dequantize(q, sc, scheme, dt)
        assert torch.equal(out.cpu().view(E, K, N).transpose(1, 2), want), (scheme, dt)


@pytest.mark.parametrize("scheme", ["int4_g128", "int8_channel"])
def test_quant_gemm_matches_float64_on_dequantized_weights(device, scheme):
    k, E, bm = 2, 4, 16
    for dt in dtypes(device):
        c = gemm_case(device, dt, k=k, E=E, K=128, N=40, seed=21, gemm2=True)
        q, sc = quantize(c["w"].float().cpu(), scheme, dt)
        qw = pack_weights(q.to(device), sc.to(device), scheme)
        s, e, n = moe_align_block_size(c["topk"], bm, E, c["emap"])
        out = c["out0"].clone()
        fused_moe_gemm(out, c["x"], None, s, e, n, top_k=k, x_row_div=1, bias=c["bias"], topk_weights=c["tw"],
                       mul_routed_weight=True, block_m=bm, quant=qw)
        check_gemm(c, out, dt, gemm2=True, k=k, w=dequantize(q, sc, scheme, dt), what=f"{scheme} {dt}")


# --------------------------------------------------------------------------- OAI-style grouped GEMM


def test_permute_pairs_segments(device):
    g = torch.Generator().manual_seed(4)
    topk, emap = make_routing(g, 7, 3, 9, 5)
    perm, seg = permute_pairs(topk.to(device), 5, emap.to(device))
    perm, seg = perm.cpu(), seg.cpu()
    loc = local_ids(topk, emap, 5)
    assert perm.dtype == torch.int64 and seg.dtype == torch.int32 and seg.shape == (6,)
    assert sorted(perm.tolist()) == (loc >= 0).nonzero().squeeze(1).tolist()
    for e in range(5):
        part = perm[seg[e]:seg[e + 1]]
        assert bool((loc[part] == e).all()) and torch.equal(part, part.sort().values)


def test_grouped_gemm_pipeline_and_scatter_sum(device):
    """GEMM1 gathers x[p // k] in the permuted layout; GEMM2 reads the permuted x in place with the routing
    weight; scatter_sum equals moe_sum over the unpermuted layout bit for bit."""
    k, E, K, N, H = 2, 4, 72, 40, 24
    for dt in dtypes(device):
        c = gemm_case(device, dt, k=k, E=E, K=K, N=N, seed=31)
        perm, seg = permute_pairs(c["topk"], E, c["emap"])
        pc, loc = perm.cpu(), c["loc"]
        y1 = torch.full((perm.numel(), N), float("nan"), dtype=dt, device=device)
        grouped_gemm(y1, c["x"], c["w"], perm, seg, x_row_div=k, bias=c["bias"], block_m=16)
        v, b = gemm_truth(c["x"].cpu(), c["w"].cpu(), pc // k, loc[pc], c["bias"].cpu())
        assert_in_interval(y1.cpu(), v, b, dt, f"grouped gemm1 {dt}")
        g = torch.Generator().manual_seed(32)
        w2 = rand(g, E, H, N, scale=N ** -0.5).to(dt).to(device)
        y2 = torch.empty(perm.numel(), H, dtype=dt, device=device)
        grouped_gemm(y2, y1, w2, perm, seg, x_row_div=1, x_permuted=True, topk_weights=c["tw"],
                     mul_routed_weight=True, config=GemmConfig(block_n=16, block_k=16, group_m=1))
        v, b = gemm_truth(y1.cpu(), w2.cpu(), torch.arange(pc.numel()), loc[pc],
                          weights=c["tw"].cpu().reshape(-1)[pc])
        assert_in_interval(y2.cpu(), v, b, dt, f"grouped gemm2 {dt}")
        T = c["topk"].shape[0]
        full = torch.randn(T * k, H).to(dt).to(device)  # non-local slots hold garbage moe_sum must skip
        full[perm] = y2
        o1 = torch.empty(T, H, dtype=dt, device=device)
        o2 = torch.empty(T, H, dtype=dt, device=device)
        moe_sum(full.view(T, k, H), o1, valid=(loc >= 0).view(T, k).to(device))
        scatter_sum(o2, y2, perm, k)
        assert torch.equal(o1, o2), dt


# ------------------------------------------------------------------------------------------- moe_sum


def test_moe_sum_fp32_accumulation_one_rounding(device):
    g = torch.Generator().manual_seed(41)
    T, k, H = 6, 4, 40
    for dt in dtypes(device):
        c3 = (torch.randn(T, k, H, generator=g) * torch.logspace(-3, 2, H)).to(dt)
        valid = torch.rand(T, k, generator=g) > 0.3
        valid[0] = False  # a token with no local slot sums to 0
        valid[1] = True
        for vm in (valid, None):
            out = torch.full((T, H), float("nan"), dtype=dt, device=device)
            moe_sum(c3.to(device), out, None if vm is None else vm.to(device))
            m = torch.ones(T, k, dtype=torch.bool) if vm is None else vm
            v = (c3.double() * m[..., None]).sum(1)
            b = gamma(k) * (c3.double().abs() * m[..., None]).sum(1)
            assert_in_interval(out.cpu(), v, b, dt, f"moe_sum {dt}")
            acc = torch.zeros(T, H)  # the kernel's promise: slots added in order to a 0.0 fp32 accumulator
            for j in range(k):
                acc = torch.where(m[:, j, None], acc + c3[:, j].float(), acc)
            assert torch.equal(out.cpu(), acc.to(dt)), dt
            if vm is not None:
                assert bool((out[0] == 0).all()), "a token without local slots must sum to 0"



# ----------------------------------------------------------------------------------------- bad input


def _bad_calls(device):
    """(name, call, exception type, text the message must contain)."""
    dt = torch.float16
    c = gemm_case(device, dt, k=2, E=4, seed=51)
    s, e, n = moe_align_block_size(c["topk"], 16, 4, c["emap"])
    out = c["out0"].clone()

    def gemm(**ch):
        kw = dict(out=out, x=c["x"], w=c["w"], sorted_token_ids=s, expert_ids=e, num_tokens_post_padded=n, top_k=2,
                  x_row_div=2, block_m=16)
        kw.update(ch)
        return lambda: fused_moe_gemm(**kw)

    bad_e = e.clone()
    bad_e[0] = 9
    q = torch.randint(-8, 8, (2, 8, 128), dtype=torch.int8)
    perm, seg = permute_pairs(c["topk"], 4, c["emap"])
    return [
        ("x-dtype", gemm(x=c["x"].float()), TypeError, "x must be"),
        ("w-dims", gemm(w=c["w"][0]), ValueError, "w must be 3-D"),
        ("x-row-div", gemm(x_row_div=3), ValueError, "x_row_div"),
        ("x-rows", gemm(x=c["x"][:-1]), ValueError, "x must have shape"),
        ("block-m", gemm(block_m=24), ValueError, "block_m"),
        ("expert-ids-len", gemm(expert_ids=e[:-1]), ValueError, "expert_ids"),
        ("expert-ids-range", gemm(expert_ids=bad_e), ValueError, "expert_ids must hold"),
        ("weights-missing", gemm(mul_routed_weight=True), ValueError, "topk_weights"),
        ("w-and-quant", gemm(quant=pack_weights(q, torch.rand(2, 8, 1), "int4_g128")), ValueError, "not both"),
        ("bias-shape", gemm(bias=c["bias"][:, :-1]), ValueError, "bias"),
        ("align-ids-dtype", lambda: moe_align_block_size(c["topk"].long(), 16, 4), TypeError, "topk_ids"),
        ("align-block", lambda: moe_align_block_size(c["topk"], 0, 4), ValueError, "block_size"),
        ("pack-range", lambda: pack_weights(q + 8, torch.rand(2, 8, 1), "int4_g128"), ValueError, "q values"),
        ("pack-group", lambda: pack_weights(q[..., :100], torch.rand(2, 8, 1), "int4_g128"), ValueError, "divisible"),
        ("pack-scheme", lambda: pack_weights(q, torch.rand(2, 8), "int3"), ValueError, "scheme"),
        ("grouped-seg", lambda: grouped_gemm(torch.empty(perm.numel(), 40, dtype=dt, device=device), c["x"], c["w"],
                                             perm, seg[:-1], x_row_div=2), ValueError, "seg_offsets"),
        ("scatter-repeat", lambda: scatter_sum(torch.empty(6, 40, dtype=dt, device=device),
                                               torch.empty(2, 40, dtype=dt, device=device),
                                               torch.tensor([1, 1], device=device), 2), ValueError, "repeat"),
        ("sum-valid", lambda: moe_sum(out.view(6, 2, 40), torch.empty(6, 40, dtype=dt, device=device),
                                      torch.ones(6, 2, dtype=torch.int32, device=device)), TypeError, "valid"),
    ]


def test_bad_input_named_before_launch(device):
    for name, call, exc, text in _bad_calls(device):
        with pytest.raises(exc, match=text):
            call()
