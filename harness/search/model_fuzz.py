"""`fuzz --model`: the search at a served layer's shape. Every drawn case takes the fields the layer fixes (H, I, E,
top_k, activation, biases, the w13 slice count: harness.check.model_plan.fixed_fields) and a token count of the list; the
rest of the draw (ranks, slots, mapping, layout, dtype, offsets, scales) stays free, so the search shrinks toward the
smallest failing case at that shape. Cases the backend declines, or the machine cannot hold, are not drawn; with
--jobs, as many campaigns run as the device holds at that shape (`jobs_that_fit`)."""
from __future__ import annotations

from hypothesis import strategies as st

from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.build.case_memory import free_bytes, gib, memory_need
from moe_lora_harness.harness.spec.contract import support_for
from moe_lora_harness.harness.check.model_plan import fixed_fields

# decode to a prefill chunk: where a campaign's examples are cheap enough to be many (check --model adds 16384)
FUZZ_TOKENS = (1, 7, 64, 256, 4096 + 17)


def served_cases(strategy, layer, spec, device: str, *, tp: int = 1, ep: int = 1, tokens=FUZZ_TOKENS,
                 share: int = 1):
    """`strategy`'s cases at `layer`'s shape (one TP / EP rank's slice), with a token count from `tokens`; only
    those `spec` claims on `device` and that fit its free memory (a `share`-th of it: the jobs of one device)."""
    # per pass (the w13 slice count is the layer's); a TP / EP degree the layer does not divide by raises here
    free = free_bytes(device)[0] // max(int(share), 1)
    return _claimed_at_layer(strategy, layer, spec, device, tp, ep, tokens).filter(
        lambda case: memory_need(case, device).total <= free)


def _claimed_at_layer(strategy, layer, spec, device: str, tp: int, ep: int, tokens):
    """`strategy`'s cases at `layer`'s shape with a token count of `tokens`, those `spec` claims on `device`."""
    fixed = {which: fixed_fields(layer, tp, ep, which) for which in ("w13", "w2")}

    def at_layer(drawn: tuple) -> Case:
        case, T = drawn
        return case.replace(**fixed[case.which], T=T)

    def keep(case: Case) -> bool:
        return not case.problems() and support_for(spec, case, device)[0]

    return st.tuples(strategy, st.sampled_from(tuple(tokens))).map(at_layer).filter(keep)


FIT_SAMPLE = 24     # the seeded draws whose memory needs decide how many campaigns one device holds at a layer


def jobs_that_fit(strategy, layer, spec, device: str, jobs: int, *, tp: int = 1, ep: int = 1,
                  tokens=FUZZ_TOKENS) -> tuple[int, str]:
    """(campaigns, why): at most `jobs` campaigns such that the median of FIT_SAMPLE seeded claimed draws at the
    layer fits one campaign's share of the device's free memory (each job filters its draws by its share: a share
    below every draw's need leaves it nothing to test); why says what was measured when that is fewer than `jobs`,
    else "". ValueError when the device cannot hold even the smallest draw."""
    from moe_lora_harness.harness.draw.strategies import examples
    cases = examples(_claimed_at_layer(strategy, layer, spec, device, tp, ep, tokens), FIT_SAMPLE)
    if not cases:
        return jobs, ""
    needs = sorted(memory_need(c, device).total for c in cases)
    free, where = free_bytes(device)
    if needs[0] > free:
        raise ValueError(f"{layer.name}'s smallest drawn case needs {gib(needs[0])} and the device has {gib(free)} "
                         f"({where}): nothing at this shape fits (one rank's slice, --tp or --ep, needs less)")
    median = needs[len(needs) // 2]
    fit = max(1, min(int(jobs), free // max(median, 1)))
    if fit >= jobs:
        return jobs, ""
    return fit, (f"{fit} job(s) instead of {jobs}: half of the drawn cases at {layer.name}'s layer need more than "
                 f"{gib(median)} and the device has {gib(free)} ({where})")
