"""Planted bugs: op and expert backends that are wrong in one known way each, to prove the harness catches them.

Each op mutant is the reference op (one-shot rounding, so a correct one would pass) with one defect of a
class seen in real kernels; each expert mutant is one TP rank's reference expert forward (for the
simulated tensor-parallel ranks) with one defect of sharding. `suites/harness/test_mutants.py` requires every one of them to fail on a case
where its defect shows, and the unmutated control to pass. They double as examples of `--backend`:
`moe-lora-harness check --backend moe_lora_harness.harness.selftest.mutants:MUTANTS --only mutant-drops-slice`.
"""
from __future__ import annotations

import functools

import torch

from moe_lora_harness.harness.spec.contract import BackendSpec, Capabilities
from moe_lora_harness.reference.lora_op import fused_moe_lora as _ref_op


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


def skips_last_active_lora(**kw):
    """Launches one LoRA fewer than num_active_loras (an off-by-one in the grid's LoRA axis): the last active
    slot gets no delta. At vLLM's default (L+1) the last entry is usually -1 padding; specialized, it is a slot."""
    n = int(kw["num_active_loras"].reshape(-1)[0])
    _call(kw, num_active_loras=torch.tensor([max(0, n - 1)], dtype=torch.int32))


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
    "skips-last-active-lora": skips_last_active_lora,
}


def _spec(name, fn):
    @functools.wraps(fn)
    def op(**kw):   # the harness passes fused_moe_lora's arguments by keyword
        fn(**kw)
    return BackendSpec(name=f"mutant-{name}", description=fn.__doc__.strip(),
                       capabilities=Capabilities(levels=frozenset({"op"})), op=op, precision="one_shot")


def _rank_forward(call, *, w2_offset_rank=None, join=True, w2_delta=True):
    """One TP rank's expert forward by the reference (one-shot rounding), written into call.output
    (`w2_delta` False: this rank adds no w2 LoRA delta)."""
    from moe_lora_harness.reference.adapters import StackedMoELoRA
    from moe_lora_harness.reference.experts import LoRACollectives, LoRAInputs, moe_experts_forward
    from moe_lora_harness.reference.precision import precision

    dt = call.output.dtype
    cpu = lambda t: None if t is None else t.detach().cpu()  # noqa: E731
    lora = coll = None
    offset = 0
    if call.w13_lora_a is not None:
        stacked = StackedMoELoRA([cpu(t) for t in call.w13_lora_a], [cpu(t) for t in call.w13_lora_b],
                                 [cpu(t) for t in call.w2_lora_a],
                                 [cpu(t) if w2_delta else torch.zeros_like(cpu(t)) for t in call.w2_lora_b],
                                 cpu(call.adapter_enabled))
        lora = LoRAInputs(stacked, cpu(call.token_lora_mapping))
        if call.fully_sharded:
            rank = call.tp_rank if w2_offset_rank is None else w2_offset_rank
            offset = rank * int(call.w2_lora_b[0].shape[2])
            if join:
                coll = LoRACollectives(w13=lambda c: call.lora_collective(c, "w13"),
                                       w2=lambda c: call.lora_collective(c, "w2"))
            else:   # each rank keeps its own share: zeros for the other ranks' rank rows, no w2 reduce
                def own_w13(c):
                    parts = [c if r == call.tp_rank else torch.zeros_like(c) for r in range(call.tp_size)]
                    return torch.cat(parts, dim=-1)
                coll = LoRACollectives(w13=own_w13, w2=lambda c: c)
    out = moe_experts_forward(cpu(call.hidden_states), cpu(call.w13), cpu(call.w2), cpu(call.topk_weights),
                              cpu(call.topk_ids), activation=call.activation, precision=precision("one_shot", dt),
                              w13_bias=cpu(call.w13_bias), w2_bias=cpu(call.w2_bias), lora=lora,
                              expert_map=cpu(call.expert_map),
                              apply_router_weight_on_input=call.apply_router_weight_on_input,
                              lora_collectives=coll, w2_lora_offset=offset)
    call.output.copy_(out.value.to(dt))


EXPERT_MUTANT_FUNCTIONS = {
    "experts-control": (lambda call: _rank_forward(call), "No defect: each TP rank's reference forward."),
    "tp-w2-offset-zero": (lambda call: _rank_forward(call, w2_offset_rank=0),
                          "Fully sharded: every rank writes its H/tp slice of the w2 delta at column 0."),
    "tp-skips-lora-collectives": (lambda call: _rank_forward(call, join=False),
                                  "Fully sharded: no all-gather / all-reduce between shrink and expand (each "
                                  "rank uses only its own share)."),
    "tp-w2-delta-rank0-only": (lambda call: _rank_forward(call, w2_delta=call.tp_rank == 0),
                               "Only TP rank 0 adds its partial w2 LoRA delta (the others skip it as if it were "
                               "a replicated term)."),
}
# planted bug -> the semantic alternative (reference.semantics) it commits: the selftest requires the name
MECHANISMS = {"mutant-tp-w2-delta-rank0-only": "tp-w2-delta-one-rank",
              "mutant-ignores-routed-weight": "w2-delta-unweighted",
              "mutant-ignores-adapter-enabled": "disabled-slot-applied",
              "mutant-no-adapter-as-slot0": "no-adapter-as-slot-0"}


def _expert_spec(name, fn, doc):
    return BackendSpec(name=f"mutant-{name}", description=doc,
                       capabilities=Capabilities(levels=frozenset({"expert"}), tensor_parallel=True),
                       experts=fn, precision="one_shot")


MUTANTS = ([_spec(n, f) for n, f in MUTANT_FUNCTIONS.items()]
           + [_expert_spec(n, f, d) for n, (f, d) in EXPERT_MUTANT_FUNCTIONS.items()])
