"""Our op dispatches like vLLM 0.33.0: kernels.triton.lora_op.select_path names the path (= the rounding
model) reference.precision.vllm_dispatch_path names, over every rank up to 300 and the pair counts at the
small-batch size limit T*k*rank <= 1024; the `triton` backend's rounding model is that path."""
from __future__ import annotations


import pytest

from moe_lora_harness.backends.triton_op import dispatch_precision
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.kernels.triton.lora_op import select_path
from moe_lora_harness.reference.precision import vllm_dispatch_path

RANKS = range(1, 301)   # includes the limits 64/65 (small-batch) and 128/129 (one-shot)
LIMIT = 1024            # small-batch: T*k*rank <= 1024


def pair_counts(rank: int) -> list[int]:
    """Pair counts around the small-batch limit for `rank`, plus a few fixed ones."""
    edge = LIMIT // rank
    return sorted({0, 1, 2, 7, 16, 64, 1024, 4096, max(edge - 1, 0), edge, edge + 1})


def test_the_grid_holds_the_boundaries():
    assert {64, 65, 128, 129} <= set(RANKS)
    assert LIMIT // 64 in pair_counts(64) and LIMIT // 64 + 1 in pair_counts(64)
    assert 64 * (LIMIT // 64) <= LIMIT < 64 * (LIMIT // 64 + 1)


@pytest.mark.parametrize("fully_sharded", [False, True])
@pytest.mark.parametrize("naive", [True, False])
def test_select_path_is_vllms_dispatch(naive, fully_sharded):
    seen = set()
    for rank in RANKS:
        for pairs in pair_counts(rank):
            ours = select_path(naive=naive, max_lora_rank=rank, num_pairs=pairs, fully_sharded=fully_sharded)
            vllm = vllm_dispatch_path(naive=naive, max_rank=rank, num_pairs=pairs, fully_sharded=fully_sharded)
            assert ours == vllm, f"naive={naive} rank={rank} pairs={pairs} fully_sharded={fully_sharded}"
            seen.add(ours)
    want = {"two_kernel"} if fully_sharded else ({"small_batch"} if naive else set()) | {"one_shot", "two_kernel"}
    assert seen == want


@pytest.mark.parametrize("layout", ["naive", "sorted"])
@pytest.mark.parametrize("rank", [8, 64, 65, 128, 129, 256])
@pytest.mark.parametrize("T", [1, 4, 8, 9, 64])
def test_triton_backend_precision_is_the_dispatch_path(T, rank, layout):
    for fully_sharded in (False, True):
        case = Case(T=T, top_k=2, max_rank=rank, layout=layout, fully_sharded=fully_sharded)
        assert not case.problems(), case.problems()
        assert dispatch_precision(case) == vllm_dispatch_path(
            naive=layout == "naive", max_rank=rank, num_pairs=T * 2, fully_sharded=fully_sharded)
