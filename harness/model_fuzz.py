"""`fuzz --model`: the search at a served layer's shape. Every drawn case takes the fields the layer fixes (H, I, E,
top_k, activation, biases, the w13 slice count: harness.model_plan.fixed_fields) and a token count of the list; the
rest of the draw (ranks, slots, mapping, layout, dtype, offsets, scales) stays free, so the search shrinks toward the
smallest failing case at that shape. Cases the backend declines, or the machine cannot hold, are not drawn."""
from __future__ import annotations

from hypothesis import strategies as st

from moe_lora_harness.harness.case import Case
from moe_lora_harness.harness.case_memory import free_bytes, memory_need
from moe_lora_harness.harness.contract import support_for
from moe_lora_harness.harness.model_plan import fixed_fields

# decode to a prefill chunk: where a campaign's examples are cheap enough to be many (check --model adds 16384)
FUZZ_TOKENS = (1, 7, 64, 256, 4096 + 17)


def served_cases(strategy, layer, spec, device: str, *, tp: int = 1, ep: int = 1, tokens=FUZZ_TOKENS,
                 share: int = 1):
    """`strategy`'s cases at `layer`'s shape (one TP / EP rank's slice), with a token count from `tokens`; only
    those `spec` claims on `device` and that fit its free memory (a `share`-th of it: the jobs of one device)."""
    # per pass (the w13 slice count is the layer's); a TP / EP degree the layer does not divide by raises here
    fixed = {which: fixed_fields(layer, tp, ep, which) for which in ("w13", "w2")}
    free = free_bytes(device)[0] // max(int(share), 1)

    def at_layer(drawn: tuple) -> Case:
        case, T = drawn
        return case.replace(**fixed[case.which], T=T)

    def keep(case: Case) -> bool:
        return (not case.problems() and support_for(spec, case, device)[0]
                and memory_need(case, device).total <= free)

    return st.tuples(strategy, st.sampled_from(tuple(tokens))).map(at_layer).filter(keep)
