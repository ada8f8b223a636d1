"""Planted shape-class bugs in a real Triton op: each is our `triton` backend, correct except on one class of
shapes (a token past a block edge, a K that is not a multiple of 8, rank 1, top_k past 4, an N tail past 32,
add_inputs=False with two slices) or of values (float16 results below its smallest normal). They pay the real kernel's compile on a GPU, so the time a campaign takes
to find them measures what the compile-class palette is for: finding shape bugs sooner in wall time, at no
loss of reach (bench/bench_fuzz.py --mutants; `moe-lora-harness selftest --corpus reach`).

A defect is planted around the correct call: an input changed first, or part of the output put back to what
it held before the kernel ran (the base values, or the harness's NaN poison under add_inputs=False).
"""
from __future__ import annotations

import dataclasses

import torch

from moe_lora_harness.harness.spec.case import SUBNORMAL_OP_MAGNITUDE
from moe_lora_harness.harness.spec.registry import BUILTIN_REF, load_ref

BASE = "triton"
PAST_TOKENS = 16        # a token loop that stops at the first block
WIDE_N = 32


def _base():
    return next(s for s in load_ref(BUILTIN_REF) if s.name == BASE)


def _tokens(kw) -> int:
    return int(kw["token_lora_mapping"].shape[0])


def _n_slice(kw) -> int:
    return int(kw["lora_b_stacked"][0].shape[-2])


def _keep_before(op, kw, region):
    """Run `op`, then put `region(output)` back to what it held before (that part was never written)."""
    out = kw["output"]
    before = out.clone()
    op(**kw)
    idx = region(kw)
    if idx is not None:
        out[idx] = before[idx]


def drops_tokens_past_16(op, **kw):
    """Tokens after the 16th get no delta (a token loop bounded by one block)."""
    _keep_before(op, kw, lambda kw: (slice(PAST_TOKENS, None),) if _tokens(kw) > PAST_TOKENS else None)


def ignores_k_tail(op, **kw):
    """Where K is not a multiple of 8, the last column of x is not read (a vector-width K loop)."""
    x = kw["qcurr_hidden_states"]
    if x.shape[-1] % 8:
        x = x.clone()
        x[:, -1] = 0
    op(**dict(kw, qcurr_hidden_states=x))


def doubles_rank_1(op, **kw):
    """At max rank 1 the expand adds the delta twice (a rank-1 special case)."""
    if kw["max_lora_rank"] == 1:
        kw = dict(kw, lora_b_stacked=[b * 2 for b in kw["lora_b_stacked"]])
    op(**kw)


def drops_last_slot_past_top_k_4(op, **kw):
    """With top_k > 4 the last routed slot of each token is not written (a fixed slot count of 4)."""
    _keep_before(op, kw, lambda kw: (slice(None), -1) if kw["top_k_num"] > 4 else None)


def drops_n_tail_past_32(op, **kw):
    """Where N > 32 is not a multiple of 32, the last column of every slice is not written (a tile mask)."""
    def region(kw):
        n = _n_slice(kw)
        if n <= WIDE_N or n % WIDE_N == 0:
            return None
        off = kw.get("offset", 0)
        cols = [off + s * n + n - 1 for s in range(len(kw["lora_b_stacked"]))]
        return (slice(None), slice(None), torch.tensor(cols))
    _keep_before(op, kw, region)


def skips_slice_2_without_add_inputs(op, **kw):
    """With add_inputs=False and two slices, the second slice is never stored (two settings together)."""
    def region(kw):
        if kw.get("add_inputs", True) or len(kw["lora_b_stacked"]) < 2:
            return None
        n, off = _n_slice(kw), kw.get("offset", 0)
        return (slice(None), slice(None), slice(off + n, off + 2 * n))
    _keep_before(op, kw, region)


def flushes_subnormals(op, **kw):
    """Results below the dtype's smallest normal are flushed to zero (an FTZ conversion of the output)."""
    op(**kw)
    out = kw["output"]
    out[(out.abs() < torch.finfo(out.dtype).smallest_normal) & (out != 0)] = 0     # zeros are no subnormals


# name -> (defect, the cases where it shows: a predicate on the Case, for reach rates; the delta must also be
# non-zero there, so it bounds the chance that one example catches the bug from above)
DEFECTS = {
    "tokens-past-16": (drops_tokens_past_16, lambda c: c.T > PAST_TOKENS),
    "k-tail": (ignores_k_tail, lambda c: c.K % 8 != 0),
    "rank-1": (doubles_rank_1, lambda c: c.max_rank == 1),
    "top-k-past-4": (drops_last_slot_past_top_k_4, lambda c: c.top_k > 4),
    "n-tail-past-32": (drops_n_tail_past_32, lambda c: c.N > WIDE_N and c.N % WIDE_N != 0),
    "slice-2-without-add-inputs": (skips_slice_2_without_add_inputs, lambda c: not c.add_inputs and c.num_slices == 2),
    # float16 results from hidden states (and, at op level, the output buffer) scaled into its subnormal range
    # (strategies.MAGNITUDES): written alone or added to the buffer, both subnormal
    "subnormal-flush": (flushes_subnormals,
                        lambda c: c.dtype == "float16" and c.magnitude <= SUBNORMAL_OP_MAGNITUDE),
}


def _wrap(base, name, defect):
    def op(**kw):   # the harness passes fused_moe_lora's arguments by keyword
        defect(base.op, **kw)
    return dataclasses.replace(base, name=f"reach-{name}", op=op, origin="",
                               description=f"{base.name} with a planted bug: {defect.__doc__.strip()}")


def _build():
    base = _base()
    control = dataclasses.replace(base, name="reach-control", origin="",
                                  description=f"{base.name} unchanged (the control)")
    return [control] + [_wrap(base, n, d) for n, (d, _) in DEFECTS.items()]


REACH_MUTANTS = _build()
