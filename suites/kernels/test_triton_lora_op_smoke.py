"""Quick direct checks of our Triton MoE-LoRA op and align against the float64 reference.

On CPU the kernels run in the Triton interpreter (TRITON_INTERPRET=1, fp16/fp32 only, small shapes);
with a CUDA device the same cases also run there, plus bf16. Each path is compared with the
reference emulating ITS rounding points (one-shot / two-kernel / small-batch); elements the op must
not write are compared bit for bit against a random (poisoned) buffer.
"""
from __future__ import annotations


import pytest
import torch

from moe_lora_harness.kernels.triton import align as talign
from moe_lora_harness.kernels.triton import lora_op
from moe_lora_harness.kernels.triton.one_shot import OneShotConfig, run_one_shot
from moe_lora_harness.op_contract.validate import validate_call
from moe_lora_harness.reference import align as ralign
from moe_lora_harness.reference.lora_op import fused_moe_lora_expected
from moe_lora_harness.reference.precision import precision

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # CPU tensors need the interpreter
ULPS = 4.0  # per-element bound in output-dtype ulps of the element's forward-error scale (error-model notes)


def make_case(dev, dt, *, T=5, k=2, E=4, L=3, K=48, N=40, R=8, S=2, naive=False, mul=False, bm=16,
              offset=3, add=True, shared=None, seed=0, rank_b=None):
    """Random, non-trivial op inputs: mapping with -1, one disabled slot, random prev, odd sizes."""
    g = torch.Generator().manual_seed(seed)

    def rn(*shape):
        return (torch.randn(*shape, generator=g) * 0.5).to(dt).to(dev)

    W = offset + S * N + 2
    x = rn(T * k if mul else T, K)
    A = [rn(L, 1 if shared == "a" else E, R, K) for _ in range(S)]
    B = [rn(L, 1 if shared == "b" else E, N, rank_b or R) for _ in range(S)]
    if shared == "expand":  # real stride-0 views along the expert dim
        A = [a[:, :1].expand(L, E, R, K) for a in A]
    w = torch.rand(T, k, generator=g).to(dev)
    topk = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32).to(dev)
    mapping = torch.randint(-1, L, (T,), generator=g).to(torch.int32)
    mapping[0], mapping[-1] = 0, -1
    mapping = mapping.to(dev)
    enabled = torch.ones(L + 1, dtype=torch.int32, device=dev)
    enabled[L - 1] = 0
    lora_ids = ralign.active_lora_ids(mapping, L)
    nact = torch.tensor([L + 1], dtype=torch.int32)
    if naive:
        sids = ntpp = None
        eids = topk.reshape(-1).contiguous()
    else:
        sids, eids, ntpp = ralign.align_alloc(topk, bm, E, L)
        talign.moe_lora_align_block_size(topk, mapping, E, bm, L, sids.shape[1], eids.shape[1], sids, eids, ntpp,
                                         enabled, lora_ids)
    out = rn(T, k, W)
    args = [out, x, A, B, w, sids, eids, ntpp, mapping, R, k, lora_ids, nact, enabled,
            bm, 16, 32, 8, 4, 3, 1, bm, 64, 16, 8, 4, 3, 1]
    return args, dict(mul_routed_weight=mul, offset=offset, add_inputs=add)


def check_against_reference(path, args, kw, prec_name=None, fully_sharded=False, collective=None, run=None):
    """Run `path` in place and compare with the reference emulating `prec_name` (default: the path's)."""
    out = args[0]
    prev = out.clone()
    prec = precision(prec_name or path, out.dtype)
    ref_coll = None if collective is None else (lambda c: collective(c.to(out.dtype)).double())
    exp = fused_moe_lora_expected(validate_call(*args, fully_sharded=fully_sharded, **kw), precision=prec,
                                  collective=ref_coll)
    if run is not None:
        run()
    elif collective is not None:
        lora_op.ENTRY_POINTS[path](*args, **kw, fully_sharded=fully_sharded, collective=collective)
    else:
        lora_op.ENTRY_POINTS[path](*args, **kw, fully_sharded=fully_sharded)
    wr = exp.written
    assert int(wr.sum()) > 0, "case writes nothing: it could not fail"
    assert torch.equal(out[~wr], prev[~wr]), "an element that must stay untouched was written"
    err = ((out.double() - exp.value).abs() / exp.scale.clamp_min(1e-300))[wr]
    ulps = float(err.max()) / torch.finfo(out.dtype).eps
    return ulps


def dtypes_for(dev):
    return [torch.float16, torch.float32] + ([torch.bfloat16] if dev == "cuda" else [])


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("path,naive,mul,add", [
    ("one_shot", False, False, True), ("one_shot", True, True, True), ("one_shot", False, True, False),
    ("two_kernel", False, True, True), ("two_kernel", True, False, False),
    ("small_batch", True, False, True), ("small_batch", True, True, False),
])
def test_paths_match_reference(dev, path, naive, mul, add):
    for dt in dtypes_for(dev):
        args, kw = make_case(dev, dt, naive=naive, mul=mul, add=add, seed=hash((path, naive, mul)) % 1000)
        assert check_against_reference(path, args, kw) <= ULPS, (path, dt)


@pytest.mark.parametrize("dev", DEVICES)
def test_small_batch_rounding_differs_from_one_shot_model(dev):
    """The comparison can fail: small-batch output is NOT the one-shot rounding model (fp16, tight bound)."""
    args, kw = make_case(dev, torch.float16, naive=True, K=64, N=64, R=16, seed=7)
    ulps = check_against_reference("small_batch", args, kw, prec_name="one_shot")
    assert ulps > 0.0
    args, kw = make_case(dev, torch.float16, naive=True, K=64, N=64, R=16, seed=7)
    assert check_against_reference("small_batch", args, kw) <= ULPS


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("shared", ["a", "b", "expand"])
def test_shared_lora_and_padded_rank(dev, shared):
    for path, R in (("one_shot", 20), ("two_kernel", 12)):
        args, kw = make_case(dev, torch.float16, R=R, shared=shared, seed=3)
        assert check_against_reference(path, args, kw) <= ULPS, (path, shared)


@pytest.mark.starts_first
@pytest.mark.parametrize("dev", DEVICES)
def test_one_shot_configs_sub_block_npid_and_slices(dev):
    """Sub-blocks below the align block, N split across programs, split-K (last arriver expands; split_k=8
    exceeds the K tiles and is clamped), fused and separate slices, the streaming regime's expand pipeline
    depth and register cap (compiled on a GPU; no-ops in the interpreter) agree."""
    for cfg in (OneShotConfig(16, 3, 16, 16, True, 4, 2), OneShotConfig(32, 1, 32, 32, False, 4, 2),
                OneShotConfig(64, 2, 16, 64, True, 4, 2, prefetch=True),
                OneShotConfig(16, 2, 16, 32, False, 4, 2, prefetch=True),
                OneShotConfig(16, 1, 16, 16, True, 4, 2, split_k=3), OneShotConfig(32, 2, 32, 16, False, 4, 2, split_k=8),
                OneShotConfig(64, 2, 16, 32, True, 4, 2, prefetch=True, split_k=2),
                OneShotConfig(32, 3, 16, 32, False, 4, 2, split_k=2),
                OneShotConfig(32, 2, 16, 32, False, 4, 3, expand_stages=2, maxnreg=128),
                OneShotConfig(64, 1, 32, 16, True, 8, 3, prefetch=True, expand_stages=3, maxnreg=168)):
        args, kw = make_case(dev, torch.float32, T=9, k=3, E=3, K=70, N=50, S=3, bm=64, mul=True, seed=11)
        call = validate_call(*args, fully_sharded=False, **kw)
        ulps = check_against_reference("one_shot", args, kw, run=lambda: run_one_shot(call, cfg))
        assert ulps <= ULPS, cfg


@pytest.mark.parametrize("dev", DEVICES)
def test_two_kernel_large_rank_and_dispatch_fallback(dev):
    args, kw = make_case(dev, torch.float16, T=3, k=2, E=2, L=2, K=32, N=32, R=160, S=1, seed=5)
    assert lora_op.select_path(naive=False, max_lora_rank=160, num_pairs=6) == "two_kernel"
    assert check_against_reference("two_kernel", args, kw,
                                   run=lambda: lora_op.fused_moe_lora(*args, **kw)) <= ULPS


@pytest.mark.parametrize("dev", DEVICES)
def test_fully_sharded_collective_hook(dev):
    # w2: all_reduce over two identical "ranks" -> the hook doubles the cache.
    args, kw = make_case(dev, torch.float16, mul=True, S=1, seed=9)
    assert check_against_reference("two_kernel", args, kw, fully_sharded=True,
                                   collective=lambda c: c * 2) <= ULPS
    # w13: all_gather on the rank dim -> B holds rank 2R.
    args, kw = make_case(dev, torch.float16, R=8, rank_b=16, seed=10)
    assert check_against_reference("two_kernel", args, kw, fully_sharded=True,
                                   collective=lambda c: torch.cat([c, -c], dim=-1)) <= ULPS
    with pytest.raises(ValueError, match="joined rank cache"):
        lora_op.fused_moe_lora(*args, **kw, fully_sharded=True)  # no process group, no hook: rank mismatch


@pytest.mark.parametrize("dev", DEVICES)
def test_nothing_qualifies_leaves_output_untouched(dev):
    args, kw = make_case(dev, torch.float16, seed=12)
    before = args[0].clone()
    args[11] = torch.full_like(args[11], -1)  # sorted mode: every lora_ids slot is -1
    for path in ("one_shot", "two_kernel"):
        lora_op.ENTRY_POINTS[path](*args, **kw)
    assert torch.equal(args[0], before)
    nargs, nkw = make_case(dev, torch.float16, naive=True, seed=12)
    nargs[8] = torch.full_like(nargs[8], -1)  # naive mode: every token without adapter
    nbefore = nargs[0].clone()
    for path in lora_op.PATHS:
        lora_op.ENTRY_POINTS[path](*nargs, **nkw)
    assert torch.equal(nargs[0], nbefore)
    args[12] = torch.tensor([0], dtype=torch.int32)  # zero active LoRAs: no launch
    lora_op.fused_moe_lora(*args, **kw)
    assert torch.equal(args[0], before)


@pytest.mark.parametrize("dev", DEVICES)
def test_align_matches_reference(dev):
    g = torch.Generator().manual_seed(4)
    T, k, E, L, bs = 37, 3, 12, 4, 16
    topk = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    topk[3, 1] = -1
    mapping = torch.randint(-1, L, (T,), generator=g).to(torch.int32)
    enabled = torch.ones(L + 1, dtype=torch.int32)
    enabled[2] = 0  # disabled slot: rows left untouched
    lora_ids = torch.tensor([-1, 0, 1, 2, 3], dtype=torch.int32)
    emap = torch.tensor([i // 2 if i % 3 else -1 for i in range(E)], dtype=torch.int32)
    for expert_map in (None, emap):
        topk_d, mapping_d, enabled_d, ids_d = (t.to(dev) for t in (topk, mapping, enabled, lora_ids))
        em_d = None if expert_map is None else expert_map.to(dev)
        ours = ralign.align_alloc(topk_d, bs, E, L, expert_map=em_d, fill=-7)
        ref = ralign.align_alloc(topk_d, bs, E, L, expert_map=em_d, fill=-7)
        M, MB = ours[0].shape[1], ours[1].shape[1]
        talign.moe_lora_align_block_size(topk_d, mapping_d, E, bs, L, M, MB, *ours, enabled_d, ids_d, em_d)
        ralign.moe_lora_align_block_size(topk_d, mapping_d, E, bs, L, M, MB, *ref, enabled_d, ids_d, em_d)
        assert ralign.check_align(topk_d, mapping_d, E, bs, L, *ours, enabled_d, ids_d, expert_map=em_d,
                                  untouched_fill=-7) == []
        for a, b in zip(ours, ref):  # same within-bucket order (ascending pair index) -> identical
            assert torch.equal(a.cpu(), b.cpu())
        assert bool((ours[0][2] == -7).all()) and int(ours[2][2]) == -7


@pytest.mark.parametrize("dev", DEVICES)
def test_bad_arguments_raise_clear_errors(dev):
    def bad(mutate, exc, match, path="fused_moe_lora", naive=False):
        args, kw = make_case(dev, torch.float16, naive=naive, seed=2)
        mutate(args, kw)
        fn = lora_op.fused_moe_lora if path == "fused_moe_lora" else lora_op.ENTRY_POINTS[path]
        before = args[0].clone()
        with pytest.raises(exc, match=match):
            fn(*args, **kw)
        assert torch.equal(args[0], before)

    bad(lambda a, kw: a.__setitem__(14, 24), ValueError, "shrink_block_size_m")
    bad(lambda a, kw: a.__setitem__(2, [t.float() for t in a[2]]), TypeError, "lora_a_stacked")
    bad(lambda a, kw: a.__setitem__(1, a[1][:-1]), ValueError, "qcurr_hidden_states")
    bad(lambda a, kw: a.__setitem__(9, 16), ValueError, "max_lora_rank")
    bad(lambda a, kw: a.__setitem__(8, a[8].long()), TypeError, "token_lora_mapping")
    bad(lambda a, kw: kw.__setitem__("offset", 10), ValueError, "offset")
    bad(lambda a, kw: a[6].view(-1)[0:1].fill_(99), ValueError, "expert_ids", naive=True)
    bad(lambda a, kw: a[11].fill_(7), ValueError, "lora_ids")
    bad(lambda a, kw: None, ValueError, "naive layout", path="small_batch")
    bad(lambda a, kw: kw.__setitem__("fully_sharded", True), ValueError, "fully_sharded", path="one_shot")


def test_select_path():
    assert lora_op.select_path(naive=True, max_lora_rank=16, num_pairs=64) == "small_batch"
    assert lora_op.select_path(naive=True, max_lora_rank=16, num_pairs=65) == "one_shot"
    assert lora_op.select_path(naive=True, max_lora_rank=128, num_pairs=1) == "one_shot"
    assert lora_op.select_path(naive=False, max_lora_rank=16, num_pairs=1) == "one_shot"
    assert lora_op.select_path(naive=False, max_lora_rank=256, num_pairs=1) == "two_kernel"
    assert lora_op.select_path(naive=True, max_lora_rank=16, num_pairs=1, fully_sharded=True) == "two_kernel"
    assert set(lora_op.PATHS) == set(lora_op.ENTRY_POINTS)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="arrival order only varies on a GPU (the interpreter runs programs in grid order)")
def test_split_k_is_bit_identical_across_runs():
    """The split-K join sums the K chunks in a fixed order, so whichever program arrives last the output
    is the same bits: 30 launches of 8 chunks over many groups must agree exactly."""
    args, kw = make_case("cuda", torch.bfloat16, T=64, k=4, E=4, K=512, N=96, R=32, S=2, bm=16, seed=21)
    call = validate_call(*args, fully_sharded=False, **kw)
    cfg = OneShotConfig(16, 2, 32, 16, False, 4, 2, split_k=8)
    before = args[0].clone()
    outs = []
    for _ in range(30):
        args[0].copy_(before)
        run_one_shot(call, cfg)
        outs.append(args[0].clone())
    assert all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs[1:])
    assert not torch.equal(outs[0], before)  # it wrote something


# the short-sums fp32 case an H100 failed while the compiled one-shot summed its expand onto the output (fiftieth
# session); bench/onto_output_replay.py replays it on the kernel as it is and as it was
FOLDED_EXPAND_CASE = ('{"E":8,"H":2,"I":36,"T":157,"block_size_m":32,"dtype":"float32","layout":"naive",'
                      '"mapping":"skewed","max_loras":4,"max_rank":16,"seed":244586,"shared_a":true,"top_k":1}')


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels only: the interpreter runs no Triton "
                    "combiner (test_codegen_sm90 checks the code)")
def test_fp32_one_shot_adds_the_delta_once():
    """A short-sums fp32 case an H100 failed at 1.74 times the per-element bound (11 elements of rows with small rank
    values), where the compiled one-shot accumulated the expand from the previous output (test_codegen_sm90's
    `test_fp32_one_shot_sums_the_delta_apart_from_the_output`): with the delta summed apart, the judge passes it."""
    from moe_lora_harness.backends.triton_op import TRITON_ONE_SHOT
    from moe_lora_harness.harness.execution.execute import InProcess
    from moe_lora_harness.harness.execution.runner import run_case
    from moe_lora_harness.harness.spec.case import Case
    out = run_case(TRITON_ONE_SHOT, Case.from_json(FOLDED_EXPAND_CASE), "cuda", executor=InProcess(), reruns=0)
    assert out.status == "pass", out.detail
