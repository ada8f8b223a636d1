"""Planted bugs: op backends that are wrong in one known way each, to prove the harness catches them.

Each mutant is the reference op (one-shot rounding, so a correct one would pass) with one defect of a
class seen in real kernels. `suites/harness/test_mutants.py` requires every one of them to fail on a case
where its defect shows, and the unmutated control to pass. They double as examples of `--backend`:
`moe-lora-harness check --backend harness.mutants:MUTANTS --only mutant-drops-slice`.
"""
from __future__ import annotations

import functools

import torch

from harness.contract import BackendSpec, Capabilities
from reference.lora_op import fused_moe_lora as _ref_op


def _call(kw, **changes):
    kw = dict(kw, **changes)
    _ref_op(**kw, precision="one_shot")


def control(**kw):
    """No defect: the one-shot emulation itself."""
    _call(kw)


def bf16_operands(**kw):
    """Operands pass through bf16 (3 mantissa bits lost for fp16): a precision bug."""
    cast = lambda t: t.to(torch.bfloat16).to(t.dtype)  # noqa: E731
    _call(kw, qcurr_hidden_states=cast(kw["qcurr_hidden_states"]),
          lora_a_stacked=[cast(a) for a in kw["lora_a_stacked"]],
          lora_b_stacked=[cast(b) for b in kw["lora_b_stacked"]])


def drops_slice(**kw):
    """Only slice 0 gets its delta."""
    _call(kw, lora_a_stacked=kw["lora_a_stacked"][:1], lora_b_stacked=kw["lora_b_stacked"][:1])


def ignores_routed_weight(**kw):
    """Selects x by pair but never multiplies by the routing weight."""
    _call(kw, topk_weights=torch.ones_like(kw["topk_weights"]))


def ignores_adapter_enabled(**kw):
    """Runs disabled slots too."""
    en = torch.ones_like(kw["adapter_enabled"])
    en[-1] = 0
    _call(kw, adapter_enabled=en)


def no_adapter_as_slot0(**kw):
    """Treats tokens without an adapter (-1) as slot 0 (naive layout)."""
    _call(kw, token_lora_mapping=kw["token_lora_mapping"].clamp(min=0))


def truncates_rank(**kw):
    """Drops the last rank lane (an off-by-one in BLOCK_R masking)."""
    A = [a.clone() for a in kw["lora_a_stacked"]]
    for a in A:
        a[:, :, -1, :] = 0
    _call(kw, lora_a_stacked=A)


def clobbers_offset_columns(**kw):
    """Writes the delta correctly but zeroes the columns before `offset`."""
    _call(kw)
    if kw.get("offset", 0):
        kw["output"][:, :, :kw["offset"]] = 0


def skips_write_without_add_inputs(**kw):
    """Forgets to store when add_inputs=False (the poisoned NaN stays)."""
    if kw.get("add_inputs", True):
        _call(kw)


def wrong_x_row(**kw):
    """Reads x[p // k] even when mul_routed_weight selects x[p]."""
    if kw.get("mul_routed_weight"):
        x = kw["qcurr_hidden_states"]
        k = kw["top_k_num"]
        _call(kw, qcurr_hidden_states=x[(torch.arange(x.shape[0]) // k) * k])
    else:
        _call(kw)


MUTANT_FUNCTIONS = {
    "control": control,
    "bf16-operands": bf16_operands,
    "drops-slice": drops_slice,
    "ignores-routed-weight": ignores_routed_weight,
    "ignores-adapter-enabled": ignores_adapter_enabled,
    "no-adapter-as-slot0": no_adapter_as_slot0,
    "truncates-rank": truncates_rank,
    "clobbers-offset": clobbers_offset_columns,
    "skips-write-add-inputs-false": skips_write_without_add_inputs,
    "wrong-x-row": wrong_x_row,
}


def _spec(name, fn):
    @functools.wraps(fn)
    def op(output, qcurr_hidden_states, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids,
           expert_ids, num_tokens_post_padded, token_lora_mapping, max_lora_rank, top_k_num, lora_ids,
           num_active_loras, adapter_enabled, *tuning, **kw):
        names = ("shrink_block_size_m", "shrink_block_size_n", "shrink_block_size_k", "shrink_group_size_m",
                 "shrink_num_warps", "shrink_num_stages", "shrink_split_k", "expand_block_size_m",
                 "expand_block_size_n", "expand_block_size_k", "expand_group_size_m", "expand_num_warps",
                 "expand_num_stages", "expand_split_k")
        kw.update(dict(zip(names, tuning)))
        fn(output=output, qcurr_hidden_states=qcurr_hidden_states, lora_a_stacked=lora_a_stacked,
           lora_b_stacked=lora_b_stacked, topk_weights=topk_weights, sorted_token_ids=sorted_token_ids,
           expert_ids=expert_ids, num_tokens_post_padded=num_tokens_post_padded,
           token_lora_mapping=token_lora_mapping, max_lora_rank=max_lora_rank, top_k_num=top_k_num,
           lora_ids=lora_ids, num_active_loras=num_active_loras, adapter_enabled=adapter_enabled, **kw)
    return BackendSpec(name=f"mutant-{name}", description=fn.__doc__.strip(),
                       capabilities=Capabilities(levels=frozenset({"op"})), op=op, precision="one_shot",
                       origin="harness.mutants:MUTANTS")


MUTANTS = [_spec(n, f) for n, f in MUTANT_FUNCTIONS.items()]
