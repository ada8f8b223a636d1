"""Reference of vLLM 0.33.0's `fused_moe_lora` op (spec 1.2-1.7): which pairs get a LoRA delta, its value.

The op is split the way the kernels are: `qualifying_pairs` reproduces the launch grid's early exits,
`lora_shrink` / `lora_expand` compute u = A x and out = prev + w (B u) in float64, rounding where a
`Precision` says the production path rounds. `fused_moe_lora_expected` computes the op on a validated call
(op_contract: the reference checks no argument itself); `fused_moe_lora` is the in-place entry point with
vLLM's signature.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from moe_lora_harness.op_contract.call import OpCall
from moe_lora_harness.op_contract.entry import vllm_op
from moe_lora_harness.reference.accumulation import U32, dot_variance, own_variance
from moe_lora_harness.reference.precision import Precision, precision as make_precision, rnd, spacing_sq

_CHUNK_ELEMS = 1 << 22  # gathered weight elements per chunk (float64: 32 MiB)
GROUPED_BYTES = 1 << 28  # the padded float64 rows, weights and products one batched GEMM of _gathered_matvecs holds


@dataclass
class PairLayout:
    """The (flat pair p = t*k + j, LoRA slot, local expert) triples a production kernel processes."""

    pair: torch.Tensor  # (P,) int64
    lora: torch.Tensor  # (P,) int64
    expert: torch.Tensor  # (P,) int64

    def __len__(self) -> int:
        return int(self.pair.numel())


@dataclass
class OpExpected:
    """Expected op output (float64), which elements the op writes, and their forward-error magnitude (None when
    computed with magnitudes=False: an emulation, judged against the truth's magnitudes)."""

    value: torch.Tensor  # (T, k, W) float64
    written: torch.Tensor  # (T, k, W) bool
    scale: torch.Tensor | None  # (T, k, W) float64
    # (T, k, W) float64: the element's exposure to gradual underflow, in half subnormal spacings of the working
    # dtype: each rounding that can produce the value, times what later steps multiply its absolute error by
    # (every rounding point of every path counted: path-independent, like `scale`)
    underflow: torch.Tensor | None = None
    # (T, k, W) float64: the variance bound of the error a correct kernel's fp32 accumulation adds
    # (reference.accumulation; 0 where nothing is written)
    acc_var: torch.Tensor | None = None
    # (T, k, W) float64: the exposure to intermediate roundings a correct kernel may take the other way, in units of
    # the working dtype's eps^2: each rounding point's value squared (every point of every path, the output's own
    # rounding excepted), carried by squared coefficients (reference.accumulation)
    round_var: torch.Tensor | None = None


# ------------------------------------------------------------------------------------------ helpers


def _expert_index(weight: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """Expert index into a stacked weight: an expert dim of size 1 is a shared LoRA (always row 0)."""
    return torch.zeros_like(expert) if weight.shape[1] == 1 else expert


def _chunks(n: int, per_item: int):
    step = max(1, _CHUNK_ELEMS // max(1, per_item))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def _gathered_matvecs(w: torch.Tensor, lora, expert, jobs: dict, prec: Precision | None = None, *,
                      batched: bool | None = None) -> dict:
    """{name: (vec (P, inner) float64, how)} -> {name: out[p] = f(w[lora[p], expert[p]]) @ vec[p]} in float64, how
    None: w (the value; `prec` with an alternative GEMM model computes it by that model: operand rounding per element,
    a low-precision accumulation sequential over K in the gathered per-pair form; None or a path preset: exact),
    "abs": |w| (an error-scale magnitude), "square": w*w (a variance carried through).

    Each distinct (lora, expert) weight converted once for every job, not once per pair or per magnitude. On a GPU
    (`batched` None: where the vectors lie) one batched GEMM per job and chunk of weights: the groups' rows padded to
    the chunk's largest count (groups taken largest first, chunks of at most GROUPED_BYTES whose counts are above
    half their largest). A loop over the groups launched about ten kernels per group and job there: 51 of
    DeepSeek-V3's 61 judge seconds at 16384 tokens on the H200 (4 slots x 256 experts). On the CPU the loop moves
    less memory than the padded copies and is as fast or faster; the two agree to float64 rounding (tested).
    """
    lead = w.shape[2]
    some = next(iter(jobs.values()))[0]
    out = {name: torch.empty((vec.shape[0], lead), dtype=torch.float64, device=vec.device)
           for name, (vec, _) in jobs.items()}
    if some.shape[0] == 0:
        return out
    e_idx = _expert_index(w, expert)
    hows = {how for _, how in jobs.values()}

    def forms(mat):
        f = {None: mat}
        if "abs" in hows:
            f["abs"] = mat.abs()
        if "square" in hows:
            f["square"] = mat * mat
        return f

    def product(vec, how, f):   # vec @ f(mat)^T over the last two dims: a magnitude exact, the value per `prec`
        plain = how is not None or prec is None or prec.plain_gemm
        return vec @ f[how].transpose(-1, -2) if plain else prec.mm(vec, f[None])

    if prec is not None and prec.accumulate is not None:
        for sl in _chunks(some.shape[0], w.shape[2] * w.shape[3]):
            f = forms(w[lora[sl], e_idx[sl]].to(torch.float64))  # (c, lead, inner)
            for name, (vec, how) in jobs.items():
                out[name][sl] = (prec.bmv(f[None], vec[sl]) if how is None
                                 else torch.einsum("cij,cj->ci", f[how], vec[sl]))
        return out
    key = lora * w.shape[1] + e_idx
    order = torch.argsort(key, stable=True)
    groups, counts = torch.unique_consecutive(key[order], return_counts=True)
    if not (some.is_cuda if batched is None else batched):
        start = 0
        for g, c in zip(groups.tolist(), counts.tolist()):
            idx = order[start:start + c]
            start += c
            f = forms(w[g // w.shape[1], g % w.shape[1]].to(torch.float64))
            for name, (vec, how) in jobs.items():
                out[name][idx] = product(vec[idx], how, f)
        return out
    starts = torch.cumsum(counts, 0) - counts
    by_size = torch.argsort(counts, descending=True, stable=True)
    sizes = counts[by_size].tolist()                       # the one host sync
    per_row = w.shape[3] + w.shape[2] * len(jobs)          # padded float64 elements per row and per group
    per_group = w.shape[2] * w.shape[3] * (1 + len(hows - {None}))
    ar = torch.arange(sizes[0], device=key.device)
    a = 0
    while a < len(sizes):
        most = sizes[a]
        b = min(len(sizes), a + max(1, GROUPED_BYTES // (8 * (most * per_row + per_group))))
        b = a + bisect.bisect_left([-n for n in sizes[a:b]], -(most // 2))   # no count in a chunk is half its
        gi = by_size[a:b]                                                      # largest or less: padding < 2x
        valid = ar[None, :most] < counts[gi][:, None]                      # (G, most)
        rows = order[(starts[gi][:, None] + ar[None, :most]).clamp_max(order.numel() - 1)]
        f = forms(w[groups[gi] // w.shape[1], groups[gi] % w.shape[1]].to(torch.float64))   # (G, lead, inner)
        sel = rows[valid]
        for name, (vec, how) in jobs.items():
            out[name][sel] = product(torch.where(valid[..., None], vec[rows], 0.0), how, f)[valid]
        a = b
    return out


def _gathered_matvec(w: torch.Tensor, lora, expert, vec: torch.Tensor, prec: Precision | None = None, *,
                     absolute: bool = False, square: bool = False) -> torch.Tensor:
    """One job of `_gathered_matvecs`: out[p] = w[lora[p], expert[p]] @ vec[p] (|w| with `absolute`, w*w with
    `square`)."""
    how = "abs" if absolute else "square" if square else None
    return _gathered_matvecs(w, lora, expert, {"y": (vec, how)}, prec)["y"]


def _x_rows(layout: PairLayout, top_k_num: int, mul_routed_weight: bool) -> torch.Tensor:
    # token_mapping_factor = 1 if mul_routed_weight else top_k (spec 1.2)
    return layout.pair if mul_routed_weight else torch.div(layout.pair, top_k_num, rounding_mode="floor")


# ----------------------------------------------------------------------------------- pair layout


def qualifying_pairs(
    sorted_token_ids: torch.Tensor | None,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor | None,
    token_lora_mapping: torch.Tensor,
    top_k_num: int,
    lora_ids: torch.Tensor,
    num_active_loras,
    adapter_enabled: torch.Tensor,
    num_pairs: int,
    max_loras: int,
    block_size_m: int,
) -> PairLayout:
    """Pairs the kernels' grid processes, in grid order (duplicates from a malformed align are kept).

    Naive mode (sorted_token_ids None): p in [0, T*k), lora = mapping[p // k], expert = expert_ids[p].
    Sorted mode: lora = lora_ids[i] for i < num_active_loras; blocks b with b*BM < ntpp[lora] and
    b*BM < EM; expert = expert_ids[lora, b] (-1 past its end); entries of the block that are < T*k.
    Both skip lora < 0, lora >= L, adapter_enabled[lora] == 0 and expert < 0. Takes validated arguments
    (op_contract): integer id tensors of any dtype; num_active_loras an int or a one-element tensor.
    """
    k, num_pairs, L = int(top_k_num), int(num_pairs), int(max_loras)
    mapping = token_lora_mapping.long()
    enabled = adapter_enabled.long()
    dev = mapping.device

    def lora_ok(l: torch.Tensor) -> torch.Tensor:
        ok = (l >= 0) & (l < L)
        safe = torch.where(ok, l, torch.zeros_like(l))
        return ok & (enabled[safe] != 0)

    if sorted_token_ids is None:
        eids = expert_ids.long()
        p = torch.arange(num_pairs, device=dev)
        l = mapping[torch.div(p, k, rounding_mode="floor")]
        e = eids[:num_pairs]
        keep = lora_ok(l) & (e >= 0)
        return PairLayout(pair=p[keep], lora=l[keep], expert=e[keep])

    sti = sorted_token_ids.long()
    eids = expert_ids.long()
    ntpp = num_tokens_post_padded.long()
    ids = lora_ids.long()
    bm = int(block_size_m)
    EM = sti.shape[1]
    nb = -(-EM // bm)
    b = torch.arange(nb, device=dev)
    pairs, loras, experts = [], [], []
    for i in range(int(num_active_loras)):
        l = ids[i]
        if not bool(lora_ok(l.reshape(1))[0]):
            continue
        li = int(l)
        e_b = torch.full((nb,), -1, dtype=torch.long, device=dev)
        m = min(nb, eids.shape[1])
        e_b[:m] = eids[li, :m]
        blk_ok = (b * bm < ntpp[li]) & (e_b >= 0)
        row = torch.full((nb * bm,), num_pairs, dtype=torch.long, device=dev)
        row[:EM] = sti[li]
        row = row.view(nb, bm)
        ok = blk_ok[:, None] & (row < num_pairs)
        pairs.append(row[ok])
        experts.append(e_b[:, None].expand(nb, bm)[ok])
        loras.append(torch.full_like(pairs[-1], li))
    if not pairs:
        empty = torch.zeros(0, dtype=torch.long, device=dev)
        return PairLayout(empty, empty.clone(), empty.clone())
    return PairLayout(torch.cat(pairs), torch.cat(loras), torch.cat(experts))


# -------------------------------------------------------------------------------- shrink/expand


def lora_shrink(
    x: torch.Tensor,
    lora_a_stacked: Sequence[torch.Tensor],
    layout: PairLayout,
    top_k_num: int,
    mul_routed_weight: bool,
    prec: Precision,
) -> torch.Tensor:
    """u[s, i] = A_s[lora_i, expert_i] @ x_row (S, P, R) float64; x_row = x[p] if mul_routed_weight else x[p//k].

    Rounded to prec.dtype when prec.round_rank_intermediate (one-shot/two-kernel paths).
    """
    rows = x.to(torch.float64)[_x_rows(layout, top_k_num, mul_routed_weight)]
    if prec.rank_split > 1 and prec.round_rank_intermediate:
        return _split_shrink(rows, lora_a_stacked, layout, prec)
    u = torch.stack([_gathered_matvec(a, layout.lora, layout.expert, rows, prec) for a in lora_a_stacked])
    return prec.r(u) if prec.round_rank_intermediate else u


def _split_shrink(rows: torch.Tensor, lora_a_stacked, layout: PairLayout, prec: Precision) -> torch.Tensor:
    """The rank intermediate rounded twice (variant rank2x): split-K over `prec.rank_split` contiguous K
    parts, each part's partial rounded to dtype and added, in order, into a dtype buffer (r(r(u1) + r(u2)))."""
    K = rows.shape[1]
    parts = torch.tensor_split(torch.arange(K, device=rows.device), prec.rank_split)
    u = None
    for ks in parts:
        part = torch.stack([_gathered_matvec(a[..., ks], layout.lora, layout.expert, rows[:, ks], prec)
                            for a in lora_a_stacked])
        u = prec.r(part) if u is None else prec.r(u + prec.r(part))
    return u


def lora_shrinks(
    jobs: dict,
    lora_a_stacked: Sequence[torch.Tensor],
    layout: PairLayout,
    top_k_num: int,
    mul_routed_weight: bool,
) -> dict:
    """{name: (x (rows, K), how)} -> {name: (S, P, R) float64}: f(A_s[l, e]) @ x_row for every job in one pass over the
    (slot, expert) weights (how "abs": |A|, a magnitude; "square": A^2, a variance carried through; None: A, exact)."""
    idx = _x_rows(layout, top_k_num, mul_routed_weight)
    rows = {name: (x.to(torch.float64)[idx], how) for name, (x, how) in jobs.items()}
    per = [_gathered_matvecs(a, layout.lora, layout.expert, rows) for a in lora_a_stacked]
    return {name: torch.stack([p[name] for p in per]) for name in jobs}


def shrink_magnitudes(x, x_scale, x_under, x_var, x_round, lora_a_stacked, layout, top_k_num, mul_routed_weight, u,
                      *, track_var: bool = True) -> dict:
    """The magnitudes of u = A x_row (S, P, R), in one pass: `scale` |A| x_scale, `under` |A| x_under + 1 (u's own
    rounding; x_under None: not computed), and with `track_var` `var` (the fp32 accumulation's variance over K,
    x's `x_var` carried by A^2; None: an exact input; reference.accumulation) and `round` (u's own rounding, x's
    exposure `x_round` carried by A^2)."""
    K = int(x.shape[-1])
    jobs = {"scale": (x_scale, "abs")}
    if x_under is not None:
        jobs["under"] = (x_under, "abs")
    if track_var:
        x64 = x.to(torch.float64)
        jobs["var"] = ((U32 * U32 * K) * x64 * x64 + (0.0 if x_var is None else x_var.to(torch.float64)), "square")
        if x_round is not None:
            jobs["round"] = (x_round, "square")
    got = lora_shrinks(jobs, lora_a_stacked, layout, top_k_num, mul_routed_weight)
    if x_under is not None:
        got["under"] = got["under"] + 1.0
    if track_var:
        u64 = u.to(torch.float64)
        got["var"] = got["var"] + (U32 * U32 * K) * u64 * u64
        got["round"] = spacing_sq(u64) + got["round"] if "round" in got else spacing_sq(u64)
    return got


def _onto_out(start: torch.Tensor, b: torch.Tensor, cache_s: torch.Tensor, w: torch.Tensor, layout: PairLayout,
              sel: torch.Tensor) -> torch.Tensor:
    """The rank sum accumulated onto `start` (the selected pairs' output values, (P', N) float64) in fp32, one
    term w u_r B[:, r] at a time, each partial sum rounded (variant outacc: the delta never summed apart)."""
    acc = start
    lora, expert, u, ws = layout.lora[sel], layout.expert[sel], cache_s[sel].to(torch.float64), w[sel]
    for r in range(u.shape[-1]):
        term = _gathered_matvec(b[..., r:r + 1], lora, expert, u[:, r:r + 1]) * ws[:, None]
        acc = rnd(acc + term, torch.float32)
    return acc


def lora_expand(
    prev: torch.Tensor,
    cache: torch.Tensor,
    lora_b_stacked: Sequence[torch.Tensor],
    topk_weights: torch.Tensor | None,
    layout: PairLayout,
    top_k_num: int,
    mul_routed_weight: bool,
    offset: int,
    add_inputs: bool,
    prec: Precision,
    *,
    cache_scale: torch.Tensor | None = None,
    cache_underflow: torch.Tensor | None = None,
    prev_underflow: torch.Tensor | None = None,
    cache_var: torch.Tensor | None = None,
    prev_var: torch.Tensor | None = None,
    cache_round: torch.Tensor | None = None,
    prev_round: torch.Tensor | None = None,
    magnitudes: bool = True,
) -> OpExpected:
    """out[t, j, offset + s*N : offset + (s+1)*N] = r(prev + r?(w * B_s[l, e] @ u)) for qualifying pairs.

    w = fp32(topk_weights[t, j]) only with mul_routed_weight; the inner r? is prec.round_delta;
    add_inputs=False writes r(d). Unwritten elements keep prev. `cache_scale` (S, P, R) is |A||x|
    from shrink_magnitudes (|cache| if None); scale = |prev|*add_inputs + |w| |B| cache_scale.
    underflow = prev_underflow*add_inputs + |w| |B| cache_underflow + 2 (the delta's rounding and the
    add's); `cache_underflow` (S, P, R) defaults to 1 (u rounded once), `prev_underflow` to 0 (an input).
    acc_var = prev_var*add_inputs + w^2 B^2 (cache_var + u^2 R cache^2) + u^2 R d^2: the fp32 accumulation's
    variance bound (reference.accumulation); `cache_var` (S, P, R) and `prev_var` default to 0 (exact inputs).
    round_var = prev_round*add_inputs + w^2 B^2 (cache_round + cache^2) + d^2: the rank intermediate's and the
    delta's roundings (this write's own rounding is the caller's to add where it is not the output's);
    `cache_round` (S, P, R) the intermediate's upstream exposure (default 0), `prev_round` prev's (default 0).
    magnitudes=False: value and written only (scale, underflow, acc_var and round_var None).
    """
    prev = prev.to(torch.float64)
    value = prev.clone()
    written = torch.zeros(prev.shape, dtype=torch.bool, device=prev.device)
    scale = prev.abs() if magnitudes else None
    under = None if not magnitudes else (
        torch.zeros_like(prev) if prev_underflow is None else prev_underflow.to(torch.float64).clone())
    var = None if not magnitudes else (
        torch.zeros_like(prev) if prev_var is None else prev_var.to(torch.float64).clone())
    rvar = None if not magnitudes else (
        torch.zeros_like(prev) if prev_round is None else prev_round.to(torch.float64).clone())
    T, k, W = prev.shape
    if len(layout) == 0:
        return OpExpected(value, written, scale, under, var, rvar)
    t = torch.div(layout.pair, k, rounding_mode="floor")
    j = layout.pair % k
    if mul_routed_weight:
        if not isinstance(topk_weights, torch.Tensor) or topk_weights.numel() != T * k:
            raise ValueError(f"topk_weights must be a (T, k)=({T}, {k}) tensor when mul_routed_weight is set")
        w = topk_weights.to(torch.float32).to(torch.float64).reshape(-1)[layout.pair]
    else:
        w = torch.ones(len(layout), dtype=torch.float64, device=prev.device)
    if magnitudes:
        cs = cache.abs() if cache_scale is None else cache_scale.to(torch.float64)
        cu = torch.ones_like(cs) if cache_underflow is None else cache_underflow.to(torch.float64)
        c64 = cache.to(torch.float64)
        R = int(cache.shape[-1])
        cv = (U32 * U32 * R) * c64 * c64 + (0.0 if cache_var is None else cache_var.to(torch.float64))
        cr = spacing_sq(c64) + (0.0 if cache_round is None else cache_round.to(torch.float64))
    # A pair listed twice (malformed align) is applied twice, in order: split into rounds of unique pairs.
    order = torch.argsort(layout.pair, stable=True)
    sp = layout.pair[order]
    first = torch.ones_like(sp, dtype=torch.bool)
    first[1:] = sp[1:] != sp[:-1]
    grp_start = torch.cummax(torch.where(first, torch.arange(len(sp), device=sp.device), 0), 0).values
    occ = torch.empty_like(sp)
    occ[order] = torch.arange(len(sp), device=sp.device) - grp_start
    for s, b in enumerate(lora_b_stacked):
        N = b.shape[2]
        jobs = {"d": (cache[s].to(torch.float64), None)}        # the value and every magnitude in one pass
        if magnitudes:
            jobs.update(scale=(cs[s], "abs"), under=(cu[s], "abs"), var=(cv[s], "square"), round=(cr[s], "square"))
        got = _gathered_matvecs(b, layout.lora, layout.expert, jobs, prec)
        d = got["d"] * w[:, None]
        if magnitudes:   # the expand's own accumulation over R and the shrink's carried through, times w^2
            own = (U32 * U32 * (R + 1)) * d * d         # the expand's last steps
            dvar = got["var"] * (w * w)[:, None] + own
            dround = got["round"] * (w * w)[:, None] + spacing_sq(d)
        if prec.round_delta:
            d = prec.r(d)
        if magnitudes:
            dscale = got["scale"] * w.abs()[:, None]
            dunder = got["under"] * w.abs()[:, None] + 2.0
        del got, jobs
        cols = torch.arange(offset + s * N, offset + (s + 1) * N, device=prev.device)
        for rnd_i in range(int(occ.max()) + 1):
            sel = occ == rnd_i
            ti, ji = t[sel][:, None], j[sel][:, None]
            cur = value[ti, ji, cols]
            if prec.onto_out:
                start = cur if add_inputs else torch.zeros_like(cur)
                value[ti, ji, cols] = prec.r(_onto_out(start, b, cache[s], w, layout, sel))
            else:
                value[ti, ji, cols] = prec.r(cur + d[sel]) if add_inputs else prec.r(d[sel])
            written[ti, ji, cols] = True
            if not magnitudes:
                continue
            # add_inputs=False drops prev's magnitude; a duplicate's earlier magnitude is kept (conservative)
            keep_prev = add_inputs or rnd_i > 0
            base = scale[ti, ji, cols] if keep_prev else torch.zeros_like(cur)
            scale[ti, ji, cols] = base + dscale[sel]
            base_u = under[ti, ji, cols] if keep_prev else torch.zeros_like(cur)
            under[ti, ji, cols] = base_u + dunder[sel]
            base_v = var[ti, ji, cols] if keep_prev else torch.zeros_like(cur)
            var[ti, ji, cols] = base_v + dvar[sel]
            base_r = rvar[ti, ji, cols] if keep_prev else torch.zeros_like(cur)
            rvar[ti, ji, cols] = base_r + dround[sel]
    return OpExpected(value, written, scale, under, var, rvar)


# ------------------------------------------------------------------------------------ the op


def _check_layout(layout: PairLayout, E: int, Ea: int, Eb: int) -> None:
    """Reject qualifying pairs a kernel would turn into out-of-bounds reads."""
    if len(layout) == 0:
        return
    if int(layout.pair.min()) < 0:
        raise ValueError("sorted_token_ids holds a negative entry in a processed block (valid range [0, T*k])")
    if max(Ea, Eb) > 1 and int(layout.expert.max()) >= E:
        raise ValueError(
            f"expert_ids holds {int(layout.expert.max())} for a qualifying pair; local expert ids must be < E={E}"
        )


def fused_moe_lora_expected(
    call: OpCall,
    *,
    precision: Precision,
    collective: Callable[[torch.Tensor], torch.Tensor] | None = None,
    collective_scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    magnitudes: bool = True,
) -> OpExpected:
    """Expected result of `fused_moe_lora` on a validated call (op_contract.validate.validate_call): its
    output read as prev, not modified.

    fully_sharded: `collective(cache (S, P, R_local) float64) -> joined cache` simulates vLLM's
    all_gather / all_reduce (None = identity); the joined cache is re-rounded when the path rounds
    the intermediate. `collective_scale` joins the matching |A||x| magnitudes; without it the error
    scale after a collective is |joined cache| (too tight if the partial caches cancel).
    magnitudes=False skips the magnitudes (an emulation is judged with the truth's).
    """
    if not isinstance(call, OpCall):
        raise TypeError(f"call must be an OpCall (op_contract.validate.validate_call(...)); got {type(call).__name__}")
    if not isinstance(precision, Precision):
        raise TypeError(f"precision must be a reference.precision.Precision; got {type(precision).__name__}")
    k, mul = call.top_k, call.mul_routed_weight
    layout = qualifying_pairs(
        call.sorted_token_ids, call.expert_ids, call.num_tokens_post_padded, call.token_lora_mapping, k,
        call.lora_ids, call.num_active, call.adapter_enabled, call.num_pairs, call.max_loras, call.block_m,
    )
    _check_layout(layout, call.num_experts, call.experts_a, call.experts_b)
    cache = lora_shrink(call.x, call.lora_a, layout, k, mul, precision)
    cache_scale = cache_var = None
    if magnitudes:
        mags = shrink_magnitudes(call.x, call.x.abs(), None, None, None, call.lora_a, layout, k, mul, cache)
        cache_scale, cache_var = mags["scale"], mags["var"]
    cache_underflow = None       # u rounded once
    cache_round, cache_part = None, cache
    if call.fully_sharded and collective is not None:
        # each rank's partial u rounded once (an all-reduce sums them), the joined u rounded again; without
        # collective_scale the number of partials is unknown: counted once
        partials = (collective_scale(torch.ones_like(cache_scale))
                    if collective_scale is not None and magnitudes else None)
        cache = collective(cache)
        if precision.round_rank_intermediate:
            cache = precision.r(cache)
        if magnitudes:
            cache_scale = collective_scale(cache_scale) if collective_scale is not None else cache.abs()
            cache_underflow = (partials if partials is not None else torch.ones_like(cache)) + 1.0
            # the partials' variances add (an all-reduce) or travel (a gather); the join's own fp32 add on top
            cache_var = (collective_scale(cache_var) if collective_scale is not None
                         else dot_variance(cache, cache * cache, call.x.shape[-1])) + own_variance(cache)
            # each partial rounded before the join (the join's re-rounding is the expand's cache rounding)
            cache_round = (collective_scale(spacing_sq(cache_part)) if collective_scale is not None
                           else spacing_sq(cache))
    if cache.shape[-1] != call.rank_b:
        raise ValueError(
            f"lora_b_stacked rank dim ({call.rank_b}) must equal the (joined) shrink rank ({cache.shape[-1]})"
        )
    return lora_expand(
        call.output, cache, call.lora_b, call.weights, layout, k, mul, call.offset, call.add_inputs, precision,
        cache_scale=cache_scale, cache_underflow=cache_underflow, cache_var=cache_var, cache_round=cache_round,
        magnitudes=magnitudes,
    )


@vllm_op
def fused_moe_lora(call: OpCall, *, precision: str | Precision = "exact") -> None:
    """vLLM 0.33.0 `fused_moe_lora` contract in place: writes rnd_dt(expected) at written elements only.

    `precision` is a preset name (built at output.dtype) or a Precision; the launch-tuning ints are
    checked by the contract and otherwise ignored (they do not change the result).
    """
    prec = precision if isinstance(precision, Precision) else make_precision(precision, call.output.dtype)
    exp = fused_moe_lora_expected(call, precision=prec)
    output = call.output
    output[exp.written] = rnd(exp.value[exp.written], output.dtype).to(output.dtype)
