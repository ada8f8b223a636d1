"""Router references (spec 7): `fused_topk` (topk_softmax / topk_sigmoid) and DeepSeek `grouped_topk`.

Scores are computed in fp32 like the production kernels; selection is deterministic with ties going
to the lower expert index (torch.topk does not promise that, so a stable descending sort is used).
"""

from __future__ import annotations

import torch

SCORING_FUNCS = ("softmax", "sigmoid")


def _check_gating(gating_output, topk) -> tuple[int, int]:
    if not isinstance(gating_output, torch.Tensor) or not gating_output.is_floating_point():
        raise TypeError("gating_output must be a floating-point torch.Tensor of shape (T, E)")
    if gating_output.dim() != 2:
        raise ValueError(f"gating_output must be 2-D (T, E); got shape {tuple(gating_output.shape)}")
    if not bool(torch.isfinite(gating_output).all()):
        raise ValueError("gating_output must be finite (no NaN/Inf)")
    T, E = gating_output.shape
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= E:
        raise ValueError(f"topk must be an int in [1, E={E}]; got {topk!r}")
    return T, E


def _scores(gating_output: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """fp32 scores: softmax exp(x - max) * (1 / sum), or sigmoid 1 / (1 + exp(-x))."""
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}; got {scoring_func!r}")
    x = gating_output.to(torch.float32)
    if scoring_func == "softmax":
        e = torch.exp(x - x.max(dim=-1, keepdim=True).values)
        return e * (1.0 / e.sum(dim=-1, keepdim=True))
    return 1.0 / (1.0 + torch.exp(-x))


def _top(values: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the n largest entries per row, ties to the lower index (iterative argmax order)."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :n]


def fused_topk(
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights fp32 (T, k), topk_ids int32 (T, k)) as vLLM's fused_topk computes them.

    Weights are the unbiased scores; with renormalize they are multiplied by
    scale = routed_scaling_factor / sum(selected) (sum in selection order, <= 0 replaced by 1).
    """
    _check_gating(gating_output, topk)
    scores = _scores(gating_output, scoring_func)
    ids = _top(scores, topk)
    w = torch.gather(scores, -1, ids)
    if renormalize:
        denom = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device)
        for j in range(topk):  # the kernel accumulates while selecting: fp32, in selection order
            denom = denom + w[:, j]
        denom = torch.where(denom > 0, denom, torch.ones_like(denom))
        scale = torch.tensor(routed_scaling_factor, dtype=torch.float32, device=w.device) / denom
        w = w * scale[:, None]
    return w.to(torch.float32), ids.to(torch.int32)


def grouped_topk(
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2/V3 grouped routing (spec 7) -> (weights fp32 (T, k), ids int32 (T, k)).

    Selection uses scores + bias when a bias is given (group score = sum of its top-2 members),
    else the scores (group score = max). The best topk_group groups are kept, the rest set to -inf,
    then top-k. Weights come from the unbiased scores; renormalize divides by their sum; the result
    is then multiplied by routed_scaling_factor (whether or not renormalize is set).
    """
    T, E = _check_gating(gating_output, topk)
    for arg, v in (("num_expert_group", num_expert_group), ("topk_group", topk_group)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{arg} must be a positive int; got {v!r}")
    if E % num_expert_group:
        raise ValueError(f"E={E} must be divisible by num_expert_group={num_expert_group}")
    if topk_group > num_expert_group:
        raise ValueError(f"topk_group must be <= num_expert_group={num_expert_group}; got {topk_group}")
    group_size = E // num_expert_group
    if topk > topk_group * group_size:
        raise ValueError(f"topk must be <= topk_group * (E / num_expert_group) = {topk_group * group_size}; got {topk}")
    scores = _scores(gating_output, scoring_func)
    if e_score_correction_bias is not None:
        b = e_score_correction_bias
        if not isinstance(b, torch.Tensor) or not b.is_floating_point() or tuple(b.shape) != (E,):
            raise ValueError(f"e_score_correction_bias must be a floating-point tensor of shape (E,)=({E},)")
        if group_size < 2:
            raise ValueError("e_score_correction_bias needs at least 2 experts per group (top-2 group score)")
        choice = scores + b.to(torch.float32)[None, :]
        grouped = choice.view(T, num_expert_group, group_size)
        group_scores = torch.gather(grouped, -1, _top(grouped, 2)).sum(dim=-1)
    else:
        choice = scores
        group_scores = scores.view(T, num_expert_group, group_size).max(dim=-1).values
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
    group_mask.scatter_(-1, _top(group_scores, topk_group), True)
    expert_mask = group_mask[:, :, None].expand(T, num_expert_group, group_size).reshape(T, E)
    masked = choice.masked_fill(~expert_mask, float("-inf"))
    ids = _top(masked, topk)
    w = torch.gather(scores, -1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        w = w * routed_scaling_factor
    return w.to(torch.float32), ids.to(torch.int32)
