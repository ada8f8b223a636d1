"""Hypothesis strategies that draw case *structure* (shapes, routing skew, LoRA mix), and the profiles.

Profiles: `ci` (derandomized, bounded, no deadline, print_blob), `dev` (more examples, random), `fuzz`
(many examples, example database on, for hunting bugs). The suites apply `suite_settings()` to each of
their tests (never hypothesis's global profile, so a user's own tests keep theirs): the profile named by
MOE_LORA_HARNESS_PROFILE (pytest: --moe-lora-profile; default ci), MOE_LORA_HARNESS_MAX_EXAMPLES (pytest:
--moe-lora-max-examples) overriding its example count.
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

from moe_lora_harness.harness.case import LAYOUTS, QUANTS, Case
from moe_lora_harness.reference.activations import SUPPORTED_ACTIVATIONS

PROFILE_ENV = "MOE_LORA_HARNESS_PROFILE"
MAX_EXAMPLES_ENV = "MOE_LORA_HARNESS_MAX_EXAMPLES"
PROFILES = ("ci", "dev", "fuzz")
_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
             HealthCheck.function_scoped_fixture]


def profile(name: str | None = None) -> settings:
    """The named profile (else $MOE_LORA_HARNESS_PROFILE, else ci), with the max-examples knob applied."""
    name = name or os.environ.get(PROFILE_ENV) or "ci"
    common = dict(deadline=None, print_blob=True, suppress_health_check=_SUPPRESS)
    if name == "ci":
        s = settings(max_examples=20, derandomize=True, database=None, **common)
    elif name == "dev":
        s = settings(max_examples=40, **common)
    elif name == "fuzz":
        s = settings(max_examples=2000, database=DirectoryBasedExampleDatabase(".hypothesis/moe-lora-fuzz"), **common)
    else:
        raise ValueError(f"hypothesis profile must be one of {PROFILES}; got {name!r} (from {PROFILE_ENV})")
    n = os.environ.get(MAX_EXAMPLES_ENV)
    if n:
        try:
            s = settings(s, max_examples=int(n))
        except ValueError:
            raise ValueError(f"{MAX_EXAMPLES_ENV} must be a positive integer; got {n!r}") from None
    return s


def suite_settings(**overrides) -> settings:
    """Settings for one of our hypothesis tests: the active profile, then the test's own `overrides`."""
    return settings(profile(), **overrides)


@st.composite
def op_cases(draw, dtypes=("float16", "float32"), max_T=12, max_dim=96, ranks=(1, 2, 4, 8, 16, 32, 64),
             large_ranks=(128, 256), allow_ep=True, layouts=LAYOUTS):
    """Op-level cases over the whole input space of `fused_moe_lora` (small shapes)."""
    E = draw(st.integers(1, 8))
    top_k = draw(st.integers(1, min(E, 4)))
    T = draw(st.integers(0, max_T))
    which = draw(st.sampled_from(("w13", "w2")))
    dims = st.one_of(st.sampled_from((16, 32, 64)), st.integers(1, max_dim))
    H, I = draw(dims), draw(dims)
    L = draw(st.integers(1, 4))
    R = draw(st.one_of(st.sampled_from(ranks), st.sampled_from(large_ranks))) if large_ranks else draw(st.sampled_from(ranks))
    slot_ranks = tuple(draw(st.lists(st.sampled_from(sorted({0, 1, max(1, R // 2), R})), min_size=0, max_size=L)))
    layout = draw(st.sampled_from(tuple(layouts)))
    ep = 1
    if allow_ep and layout == "sorted" and draw(st.booleans()):
        ep = draw(st.sampled_from((2, 4)))
        E = E * ep
        top_k = min(top_k, E)
    mul = True if which == "w2" else draw(st.booleans())
    add_inputs = draw(st.booleans())
    return Case(
        level="op", T=T, H=H, I=I, E=E, top_k=top_k, dtype=draw(st.sampled_from(dtypes)), max_loras=L,
        max_rank=R, ranks=slot_ranks,
        mapping=draw(st.sampled_from(("uniform", "mixed", "skewed", "none", "disabled"))),
        routing=draw(st.sampled_from(("uniform", "skewed"))),
        shared_a=draw(st.booleans()), shared_b=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)), which=which,
        num_slices=1 if which == "w2" else draw(st.integers(1, 2)),
        mul_routed_weight=mul, add_inputs=add_inputs, offset=draw(st.sampled_from((0, 0, 3, 17))),
        layout=layout, block_size_m=draw(st.sampled_from((16, 32, 64))),
        fully_sharded=(ep == 1 and add_inputs and draw(st.booleans())),
        ep_size=ep, ep_rank=draw(st.integers(0, ep - 1)))


EXPERT_ACTIVATIONS = SUPPORTED_ACTIVATIONS


@st.composite
def expert_cases(draw, dtypes=("float16", "float32"), max_T=10, max_dim=96, activations=EXPERT_ACTIVATIONS,
                 quants=QUANTS):
    """Expert-level cases: activation, biases, LoRA mix, shared factors, EP, simulated TP ranks (plain or
    fully-sharded LoRA), router weight on input, quant."""
    quant = draw(st.sampled_from(tuple(quants)))
    if quant == "int4_g128":
        H, I = 128, 128
    else:
        dims = st.one_of(st.sampled_from((16, 32, 64, 128)), st.integers(2, max_dim))
        H, I = draw(dims), draw(dims)
    E = draw(st.integers(1, 8))
    ep = draw(st.sampled_from((1, 1, 2)))
    E = E * ep
    top_k = draw(st.integers(1, min(E, 4)))
    on_input = top_k == 1 and draw(st.booleans())
    L = draw(st.integers(1, 3))
    R = draw(st.sampled_from((1, 4, 8, 16, 32)))
    tp = draw(st.sampled_from((1, 1, 1, 2))) if (quant == "none" and ep == 1) else 1
    fully_sharded = tp > 1 and R % tp == 0 and draw(st.booleans())
    I += I % tp                                  # TP shards I; fully-sharded LoRA also shards H and R
    H += H % tp if fully_sharded else 0
    return Case(
        level="expert", T=draw(st.integers(0, max_T)), H=H, I=I, E=E, top_k=top_k,
        dtype=draw(st.sampled_from(dtypes)), max_loras=L, max_rank=R,
        ranks=tuple(draw(st.lists(st.sampled_from(sorted({0, 1, max(1, R // 2), R})), max_size=L))),
        mapping=draw(st.sampled_from(("uniform", "mixed", "skewed", "none", "disabled"))),
        routing=draw(st.sampled_from(("uniform", "skewed"))),
        shared_a=draw(st.booleans()), shared_b=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)),
        activation=draw(st.sampled_from(activations)), bias=draw(st.booleans()), lora=draw(st.booleans()),
        apply_router_weight_on_input=on_input, quant=quant,
        ep_size=ep, ep_rank=draw(st.integers(0, ep - 1)), tp_size=tp, fully_sharded=fully_sharded)


@st.composite
def ep_cases(draw, dtypes=("float16", "float32"), max_T=12, max_dim=96,
             activations=EXPERT_ACTIVATIONS, quants=QUANTS, comms=("simulated",)):
    """Dispatched expert-parallel cases: 2 or 4 ranks with uneven token counts (0 included; up to max_T/2
    each), E = ep x local experts, the LoRA mix and mapping pattern (by_rank: each adapter used by one
    rank's tokens only)."""
    ep = draw(st.sampled_from((2, 4)))
    max_tokens_per_rank = max(1, max_T // 2)
    counts = tuple(draw(st.lists(st.integers(0, max_tokens_per_rank), min_size=ep, max_size=ep)))
    quant = draw(st.sampled_from(tuple(quants)))
    if quant == "int4_g128":
        H, I = 128, 128
    else:
        dims = st.one_of(st.sampled_from((16, 32, 64)), st.integers(2, max_dim))
        H, I = draw(dims), draw(dims)
    E = ep * draw(st.integers(1, 3))
    top_k = draw(st.integers(1, min(E, 4)))
    L = draw(st.integers(1, 3))
    R = draw(st.sampled_from((1, 4, 8, 16)))
    return Case(
        level="expert", T=sum(counts), H=H, I=I, E=E, top_k=top_k, dtype=draw(st.sampled_from(dtypes)),
        max_loras=L, max_rank=R,
        ranks=tuple(draw(st.lists(st.sampled_from(sorted({0, 1, max(1, R // 2), R})), max_size=L))),
        mapping=draw(st.sampled_from(("by_rank", "by_rank", "uniform", "mixed", "none", "disabled"))),
        routing=draw(st.sampled_from(("uniform", "skewed"))), shared_a=draw(st.booleans()),
        shared_b=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)),
        activation=draw(st.sampled_from(activations)), bias=draw(st.booleans()), lora=draw(st.booleans()),
        apply_router_weight_on_input=top_k == 1 and draw(st.booleans()), quant=quant,
        ep_size=ep, ep_tokens=counts, ep_comm=draw(st.sampled_from(tuple(comms))))


def claimed_cases(spec, device: str, level: str, **sizes):
    """Cases of `level` (op, expert, or "ep": dispatched expert-parallel only) that `spec` claims on `device`:
    drawn over its declared dtypes, layouts, activations and quant schemes, then filtered by its whole
    declaration (rules included, so nothing it declines runs)."""
    from moe_lora_harness.harness.contract import support_for
    cap = spec.capabilities
    dev = "cuda" if str(device).startswith("cuda") else str(device)
    dtypes = tuple(d for d in ("float16", "bfloat16", "float32") if d in cap.dtypes.get(dev, ()))
    if not dtypes:
        return st.nothing()
    if level == "op":
        base = op_cases(dtypes=dtypes, layouts=tuple(sorted(cap.layouts)) or LAYOUTS, **sizes)
    else:
        acts = tuple(a for a in SUPPORTED_ACTIVATIONS if cap.activations is None or a in cap.activations)
        quants = tuple(q for q in QUANTS if q in cap.quant)
        kw = dict(dtypes=dtypes, activations=acts or SUPPORTED_ACTIVATIONS, quants=quants or ("none",))
        if level == "ep":       # dispatched expert parallelism (expert-level cases with ep_tokens)
            base = ep_cases(**kw, **sizes)
        else:
            base = expert_cases(**kw, **sizes)
            if cap.expert_parallel:   # one case in four dispatched, so fuzzing reaches EP too
                base = st.one_of(base, base, base, ep_cases(**kw, **sizes))
    return base.filter(lambda c: support_for(spec, c, device)[0])
