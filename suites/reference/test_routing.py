"""Tests of reference/routing.py against brute-force Python selection (ties to the lower expert index)."""

from __future__ import annotations

import math

import pytest
import torch

from moe_lora_harness.reference.routing import fused_topk, grouped_topk

F32 = torch.float32


def _brute_ids(scores_row: list[float], k: int) -> list[int]:
    """Iterative argmax, ties to the lower index: sort by (-score, index)."""
    return [i for _, i in sorted((-s, i) for i, s in enumerate(scores_row))][:k]


def _softmax64(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.to(torch.float64), dim=-1)


def test_fused_topk_softmax_selection_and_weights():
    g = torch.Generator().manual_seed(0)
    E, k = 8, 3
    logits = torch.randn(16, E, generator=g)
    w, ids = fused_topk(logits, k, renormalize=False)
    assert w.dtype == F32 and ids.dtype == torch.int32 and ids.shape == (16, k)
    p = _softmax64(logits)
    for t in range(16):
        assert ids[t].tolist() == _brute_ids(p[t].tolist(), k)
    # fp32 softmax: exp (<= 1 ulp), sum of E terms (<= E-1 ulps), reciprocal and product (2 ulps)
    bound = (E + 3) * torch.finfo(F32).eps * p.gather(1, ids.long())
    assert bool(((w.double() - p.gather(1, ids.long())).abs() <= bound).all())


def test_fused_topk_ties_go_to_the_lower_index():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0], [5.0, 1.0, 1.0, 5.0, 0.0]])
    for scoring in ("softmax", "sigmoid"):
        _, ids = fused_topk(logits, 2, renormalize=False, scoring_func=scoring)
        assert ids.tolist() == [[1, 2], [0, 1], [0, 3]]
    _, ids = fused_topk(logits, 4, renormalize=True)
    assert ids.tolist() == [[1, 2, 4, 3], [0, 1, 2, 3], [0, 3, 1, 2]]
    # many ties in a wide row (an unstable sort or torch.topk scrambles these)
    wide = torch.zeros(2, 128)
    wide[:, ::3] = 1.0
    for scoring in ("softmax", "sigmoid"):
        _, ids = fused_topk(wide, 8, renormalize=True, scoring_func=scoring)
        assert ids.tolist() == [list(range(0, 24, 3))] * 2


def test_fused_topk_renormalize_multiplies_by_the_reciprocal():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(512, 6, generator=g)
    rsf = 2.5
    w, ids = fused_topk(logits, 3, renormalize=True, routed_scaling_factor=rsf)
    raw, raw_ids = fused_topk(logits, 3, renormalize=False)
    assert torch.equal(ids, raw_ids)
    denom = (raw[:, 0] + raw[:, 1]) + raw[:, 2]  # fp32, selection order
    by_reciprocal = raw * (torch.tensor(rsf, dtype=F32) / denom)[:, None]
    by_division = raw / denom[:, None] * rsf
    assert torch.equal(w, by_reciprocal)
    assert not torch.equal(w, by_division)  # the two forms really differ on this data (1 ulp somewhere)
    assert bool(((w.sum(1).double() - rsf).abs() <= 4 * torch.finfo(F32).eps * rsf).all())


def test_fused_topk_sigmoid_and_nonpositive_denominator():
    logits = torch.tensor([[-200.0, -300.0, -250.0], [0.5, -1.0, 2.0]])
    w, ids = fused_topk(logits, 2, renormalize=True, scoring_func="sigmoid")
    assert ids.tolist() == [[0, 1], [2, 0]]  # all three underflow to 0: a tie
    assert w[0].tolist() == [0.0, 0.0]  # sigmoid underflows to 0: denominator replaced by 1, no NaN
    s = [1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(-0.5))]
    assert w[1].tolist() == pytest.approx([s[0] / sum(s), s[1] / sum(s)], rel=4 * torch.finfo(F32).eps)


def _brute_grouped(scores, k, G, kg, bias, renormalize, rsf):
    T, E = scores.shape
    gs = E // G
    out_ids, out_w = [], []
    for t in range(T):
        row = scores[t].tolist()
        choice = [row[e] + (float(bias[e]) if bias is not None else 0.0) for e in range(E)]
        group_score = []
        for gi in range(G):
            members = sorted(choice[gi * gs:(gi + 1) * gs], reverse=True)
            group_score.append(members[0] + members[1] if bias is not None else members[0])
        keep = set(_brute_ids(group_score, kg))
        masked = [choice[e] if e // gs in keep else -math.inf for e in range(E)]
        ids = _brute_ids(masked, k)
        w = [row[e] for e in ids]
        if renormalize:
            w = [v / sum(w) for v in w]
        out_ids.append(ids)
        out_w.append([v * rsf for v in w])
    return out_ids, torch.tensor(out_w, dtype=torch.float64)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_grouped_topk_matches_brute_force(with_bias, scoring):
    g = torch.Generator().manual_seed(2)
    T, E, G, kg, k, rsf = 12, 16, 4, 2, 3, 2.5
    logits = torch.randn(T, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.5 if with_bias else None
    w, ids = grouped_topk(logits, k, True, G, kg, scoring, rsf, bias)
    x = logits.double()
    scores = torch.softmax(x, -1) if scoring == "softmax" else torch.sigmoid(x)
    b_ids, b_w = _brute_grouped(scores, k, G, kg, None if bias is None else bias.double(), True, rsf)
    assert ids.tolist() == b_ids
    # fp32 scores (<= E+3 ulps, as above) then a k-term renormalization (<= k+1 ulps) and a scaling
    assert bool(((w.double() - b_w).abs() <= (E + k + 6) * torch.finfo(F32).eps * b_w).all())


def test_grouped_topk_bias_moves_selection_not_weights():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 5.0])
    w, ids = grouped_topk(logits, 2, False, 4, 1, "sigmoid", 1.0, bias)
    assert ids.tolist() == [[6, 7]]  # only the biased group survives
    assert w.tolist() == [torch.sigmoid(torch.tensor([-3.0, -4.0])).tolist()]  # unbiased scores
    w2, ids2 = grouped_topk(logits, 2, False, 4, 1, "sigmoid", 3.0, None)
    assert ids2.tolist() == [[0, 1]]
    assert torch.equal(w2, torch.sigmoid(torch.tensor([[3.0, 2.0]])) * 3.0)  # scaled without renormalize


def test_grouped_topk_group_ties_go_to_the_lower_group():
    logits = torch.tensor([[1.0, 0.0, 1.0, 0.0, 1.0, 0.0]])
    _, ids = grouped_topk(logits, 2, True, 3, 1, "softmax")
    assert ids.tolist() == [[0, 1]]
    wide = torch.zeros(1, 128)
    wide[:, ::3] = 1.0
    _, ids = grouped_topk(wide, 6, True, 8, 4, "softmax")  # all group maxima tie: groups 0..3 kept
    assert ids.tolist() == [list(range(0, 18, 3))]


@pytest.mark.parametrize("call, text", [
    (lambda x: fused_topk(x, 9, True), "topk must be an int in"),
    (lambda x: fused_topk(x[0], 2, True), "2-D"),
    (lambda x: fused_topk(x, 2, True, scoring_func="tanh"), "scoring_func"),
    (lambda x: fused_topk(x.masked_fill(x > 1, float("nan")), 2, True), "finite"),
    (lambda x: grouped_topk(x, 2, True, 3, 1), "divisible"),
    (lambda x: grouped_topk(x, 2, True, 4, 5), "topk_group"),
    (lambda x: grouped_topk(x, 5, True, 4, 2), "topk must be <="),
    (lambda x: grouped_topk(x, 2, True, 4, 2, e_score_correction_bias=torch.zeros(3)), "shape"),
])
def test_bad_arguments_raise(call, text):
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(3)) * 2
    with pytest.raises(ValueError, match=text):
        call(x)
