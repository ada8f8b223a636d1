"""Hypothesis strategies that draw case *structure* (shapes, routing skew, LoRA mix), and the profiles.

Profiles: `ci` (derandomized, bounded, no deadline, print_blob), `dev` (more examples, random), `fuzz`
(many examples, example database on, for hunting bugs). The suites apply `suite_settings()` to each of
their tests (never hypothesis's global profile, so a user's own tests keep theirs): the profile named by
MOE_LORA_HARNESS_PROFILE (pytest: --moe-lora-profile; default ci), MOE_LORA_HARNESS_MAX_EXAMPLES (pytest:
--moe-lora-max-examples) overriding its example count.
"""
from __future__ import annotations

import itertools
import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

from moe_lora_harness.harness.draw.cache import cache_dir, keep_hypothesis_files_here
from moe_lora_harness.harness.draw.axes import (ALIGNED_DIMS, AWKWARD_DIMS, BLOCK_EDGES, BLOCK_SIZES_M, DISPATCHED_MAPPINGS,
                                           EP_RANKS, EXPERT_RANKS, LARGE_RANKS, OFFSET_CLASSES, OP_RANKS,
                                           SINGLE_RANK_MAPPINGS, declared_values)
from moe_lora_harness.harness.spec.case import (ACTIVE_LORAS, FP8_QUANTS, FP16_MASSIVE_MAGNITUDE, LAYOUTS,
                                           MASSIVE_OUTLIER_SCALE, QUANTS, ROUTINGS, SUBNORMAL_EXPERT_MAGNITUDE,
                                           SUBNORMAL_OP_MAGNITUDE, WHICH, Case)
from moe_lora_harness.harness.draw.compile_classes import palette_of
from moe_lora_harness.harness.spec.contract import support_for
from moe_lora_harness.harness.draw.profiles import CPU_DRAWS, SMALL, draw_sizes, on_gpu
from moe_lora_harness.reference.activations import SUPPORTED_ACTIVATIONS

keep_hypothesis_files_here()     # nothing of hypothesis' in the working directory (a fuzz, our suites)

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
        s = settings(max_examples=2000, database=DirectoryBasedExampleDatabase(str(cache_dir() / "examples")),
                     **common)
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


def examples(strategy, n: int, seed: int = 0) -> list:
    """n examples of `strategy` (structure only: no tensors, no kernels), from hypothesis seed `seed`: the
    same examples wherever it is called from."""
    from hypothesis import given
    from hypothesis import seed as hseed
    out = []

    @hseed(seed)
    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case):
        out.append(case)
    collect()
    return out


# Reach: the axes kernels break on, each drawn with some probability (never always: the interpreter is slow).
# A draw first picks a REGIME: "base" (the small shapes of old), "boundary" (a token count either side of a
# block / tile edge: 15/16/17 ... 127/128/129), "wide" (top_k 5..8, E >= top_k) or "many" (E 32..64 experts,
# a handful of tokens: most experts get none or one). The expensive regimes keep the other axes small so the
# average cost of an example stays about that of a base one. Shrinking goes to "base" (the first entry).
# `regimes=` narrows a strategy (e.g. ("boundary",): block-edge token counts only, for a focused campaign).
REGIMES = ("base",) * 5 + ("boundary",) * 2 + ("wide", "many")
BOUNDARY_TOKENS = tuple(e + d for e in BLOCK_EDGES for d in (-1, 0, 1))   # 15, 16, 17, ..., 127, 128, 129
MANY_EXPERTS = (32, 48, 64)
OFFSETS = dict(OFFSET_CLASSES)["0"] * 2 + dict(OFFSET_CLASSES)["nonzero"]   # no offset half the time
DTYPES_DRAWN = SMALL.dtypes     # by default what the interpreter computes (a backend's declaration gives its own)
# input scale: hidden states times a magnitude past the activations' clamps (swigluoai's 7), or so small that
# float16 values go subnormal (harness.spec.case), or outlier tokens
TINY_MAGNITUDES = (SUBNORMAL_EXPERT_MAGNITUDE, SUBNORMAL_OP_MAGNITUDE)
MAGNITUDES = (4.0, 8.0, 12.0) + TINY_MAGNITUDES
_SCALES = ("plain",) * 8 + ("magnitude", "outliers")   # one example in five (each adds draws to shrink)


def _dims(max_dim: int, aligned=ALIGNED_DIMS, min_dim: int = 1):
    """Aligned sizes, sizes either side of the 8 / 16 / 64 multiples, or any size (all <= max_dim except the
    aligned ones the caller insists on)."""
    awkward = tuple(d for d in AWKWARD_DIMS if min_dim <= d <= max_dim) or (max_dim,)
    return st.one_of(st.sampled_from(tuple(aligned)), st.sampled_from(awkward), st.integers(min_dim, max_dim))


def _upto(edges, most: int) -> tuple:
    return tuple(e for e in (edges or ()) if e <= most)


def _edge_count(draw, edges) -> int:
    """A token count one past, at or one short of a block edge (edges up to 32 twice as often: cost); drawn
    as (edge, offset) so every count is about as likely as the others of its edge."""
    edge = draw(st.sampled_from(_upto(edges, 32) * 2 + tuple(e for e in edges if e > 32)))
    return edge + draw(st.sampled_from((1, 0, -1)))      # one past the edge first: the classic dropped token


def _tokens(draw, regime: str, max_T: int, edges) -> int:
    if regime == "boundary" and edges:
        return _edge_count(draw, edges)
    if regime in ("wide", "many"):
        return draw(st.integers(1, max(1, min(max_T, 6))))
    return draw(st.integers(0, max_T))


def _experts_and_top_k(draw, regime: str, ep: int, max_top_k: int = 4):
    """(global E divisible by ep, top_k <= E) for the regime."""
    if regime == "wide":
        top_k = draw(st.integers(5, 8))
        local = draw(st.integers(-(-top_k // ep), max(-(-top_k // ep), 16 // ep)))
        return local * ep, top_k
    if regime == "many":
        E = draw(st.sampled_from(MANY_EXPERTS))      # divisible by 2 and 4
        return E, draw(st.integers(1, 4))
    E = draw(st.integers(1, 8)) * ep
    top_k = draw(st.integers(1, min(E, max_top_k if regime == "base" else 2)))
    return E, top_k


def _input_scale(draw, T: int, fp16_expert: bool) -> dict:
    """magnitude / outliers: drawn as structure (a scale and a count), never element values."""
    kind = draw(st.sampled_from(_SCALES))
    out = {}
    if kind == "magnitude" or (kind == "outliers" and not fp16_expert and draw(st.booleans())):
        out["magnitude"] = draw(st.sampled_from(MAGNITUDES))
    if kind == "outliers" and T >= 1:
        out["outliers"] = draw(st.integers(1, min(3, T)))
    return out


def _op_ep(draw, allow_ep: bool, layout: str) -> int:
    if allow_ep and layout == "sorted" and draw(st.booleans()):
        return draw(st.sampled_from((2, 4)))
    return 1


def _slot_ranks(draw, R: int, L: int) -> tuple:
    """Per-slot adapter ranks (0: an empty slot), up to L of them: 1, R/2 or R."""
    return tuple(draw(st.lists(st.sampled_from(sorted({0, 1, max(1, R // 2), R})), max_size=L)))


def _experts_for(draw, regime: str, top_k: int, ep: int) -> int:
    """E (divisible by ep, >= top_k) for a compile class's top_k: many experts in the "many" regime."""
    if regime == "many":
        return draw(st.sampled_from(tuple(e for e in MANY_EXPERTS if e >= top_k and e % ep == 0)))
    least = max(1, -(-top_k // ep))
    return draw(st.integers(least, max(least, 8))) * ep


class _Shape:
    """The shape source of one draw: free (every value drawn) or a compile class of a palette (its fixed values
    taken, the token count drawn from its window). `pick(name, strategy)` is the class's value or a draw, so a
    free draw makes exactly the draws it always made, in the same order."""

    def __init__(self, draw, palette, most_tokens=None):
        self.draw, self.fixed, self.tokens = draw, {}, None
        if palette is not None:
            classes = palette.classes if most_tokens is None else tuple(
                c for c in palette.classes if min(c.tokens) <= most_tokens)
            c = draw(st.sampled_from(classes) if classes else st.nothing())   # none fits: no example
            self.fixed = dict(c.fields)
            self.tokens = tuple(t for t in c.tokens if most_tokens is None or t <= most_tokens)

    @property
    def classed(self) -> bool:
        return self.tokens is not None

    def pick(self, name, strategy):
        return self.fixed[name] if name in self.fixed else self.draw(strategy)

    def token_count(self):
        return self.draw(st.sampled_from(self.tokens))

    def experts_and_top_k(self, regime: str, ep: int) -> tuple:
        """(E, top_k) of a classed draw: the class's top_k, E drawn for it (many experts in "many")."""
        top_k = self.fixed["top_k"]
        return _experts_for(self.draw, regime, top_k, ep), top_k


@st.composite
def op_cases(draw, dtypes=DTYPES_DRAWN, max_T=CPU_DRAWS["op"].max_T, max_dim=CPU_DRAWS["op"].max_dim, ranks=OP_RANKS,
             large_ranks=LARGE_RANKS, allow_ep=True, layouts=LAYOUTS, block_edges=BLOCK_EDGES,
             regimes=REGIMES, palette=None):
    """Op-level cases over the whole input space of `fused_moe_lora` (small shapes), with the reach regimes:
    token counts across block boundaries, top_k up to 8, many experts with few tokens, awkward K / N, input
    magnitude and outlier tokens. With a `palette` (harness.draw.compile_classes) the shapes come from its compile
    classes and everything else is drawn as without one."""
    regime = draw(st.sampled_from(tuple(regimes)))
    shape = _Shape(draw, palette)
    layout = shape.pick("layout", st.sampled_from(tuple(layouts)))
    ep = _op_ep(draw, allow_ep, layout)
    if shape.classed:
        T = shape.token_count()
        E, top_k = shape.experts_and_top_k(regime, ep)
    else:
        E, top_k = _experts_and_top_k(draw, regime, ep)
        # naive: one program per (token, slot): the edges up to 32 only, top_k 1
        naive_edge = layout == "naive" and regime == "boundary"
        T = _tokens(draw, regime, max_T, _upto(block_edges, 32) if naive_edge else block_edges)
        if naive_edge:
            top_k = 1
    which = shape.pick("which", st.sampled_from(WHICH))
    dims = _dims(max_dim) if regime == "base" else _dims(min(max_dim, 64), aligned=(16, 32))
    H, I = shape.pick("H", dims), shape.pick("I", dims)
    L = shape.pick("max_loras", st.integers(1, 4 if regime == "base" else 2))
    large = tuple(large_ranks) if regime == "base" and large_ranks else ()   # (the others are costly enough)
    R = shape.pick("max_rank", st.one_of(st.sampled_from(ranks), st.sampled_from(large)) if large
                   else st.sampled_from(ranks))
    slot_ranks = _slot_ranks(draw, R, L)
    mul = True if which == "w2" else shape.pick("mul_routed_weight", st.booleans())
    add_inputs = shape.pick("add_inputs", st.booleans())
    dtype = shape.pick("dtype", st.sampled_from(dtypes))
    case = Case(
        level="op", T=T, H=H, I=I, E=E, top_k=top_k, dtype=dtype, max_loras=L,
        max_rank=R, ranks=slot_ranks,
        mapping=draw(st.sampled_from(SINGLE_RANK_MAPPINGS)),
        routing=draw(st.sampled_from(ROUTINGS)),
        shared_a=draw(st.booleans()), shared_b=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)), which=which,
        num_slices=1 if which == "w2" else shape.pick("num_slices", st.sampled_from((2, 1))),   # gate + up first
        mul_routed_weight=mul, add_inputs=add_inputs, offset=shape.pick("offset", st.sampled_from(OFFSETS)),
        layout=layout, block_size_m=shape.pick("block_size_m", st.sampled_from(BLOCK_SIZES_M)),
        fully_sharded=(ep == 1 and add_inputs and draw(st.booleans())),
        ep_size=ep, ep_rank=draw(st.integers(0, ep - 1)), **_input_scale(draw, T, False))
    # drawn last, so the draws before it are those of earlier versions; the grid size only (no compile key)
    if layout == "sorted":
        case = case.replace(active_loras=draw(st.sampled_from(ACTIVE_LORAS)))
    return case


EXPERT_ACTIVATIONS = SUPPORTED_ACTIVATIONS


def _act_dtype(draw, activations, dtypes, shape=None):
    """(activation, dtype) drawn as one pair: every activation in every dtype the caller allows is reachable
    (a compile class fixes both)."""
    if shape is not None and shape.classed:
        return shape.fixed["activation"], shape.fixed["dtype"]
    return draw(st.sampled_from(tuple(itertools.product(tuple(activations), tuple(dtypes)))))


# decode calls (Case.call_tokens): one expert case in DECODE_CALLS_ONE_IN handed over in calls of fewer tokens, at
# most DECODE_MOST_CALLS of them (each call is a kernel launch: the interpreter's time)
DECODE_CALLS_ONE_IN = 8
DECODE_MOST_CALLS = 8


def _call_tokens(draw, T: int) -> int:
    """0 (one call), or one in DECODE_CALLS_ONE_IN: tokens per call dividing T into 2..DECODE_MOST_CALLS calls; it
    shrinks toward one call, then toward the fewest calls."""
    sizes = [d for d in range(T - 1, 0, -1) if T % d == 0 and T // d <= DECODE_MOST_CALLS]
    if not sizes or draw(st.integers(0, DECODE_CALLS_ONE_IN - 1)) != DECODE_CALLS_ONE_IN - 1:
        return 0
    return draw(st.sampled_from(sizes))


# H and I of the schemes scaled per group of 128 along K (int4_g128, fp8_block): one group, or two, so that a wrong
# group index (the scale of group 0 read for group 1) can show; shrinks toward one
_GROUPED_DIMS = st.sampled_from((128, 256))


@st.composite
def expert_cases(draw, dtypes=DTYPES_DRAWN, max_T=CPU_DRAWS["expert"].max_T, max_dim=CPU_DRAWS["expert"].max_dim,
                 activations=EXPERT_ACTIVATIONS,
                 quants=QUANTS, block_edges=BLOCK_EDGES, regimes=REGIMES, palette=None, tp_sizes=(1, 1, 1, 2)):
    """Expert-level cases: activation x dtype, biases, LoRA mix, shared factors, EP, simulated TP ranks (plain
    or fully-sharded LoRA), router weight on input, quant; the reach regimes (token counts across block
    boundaries, top_k up to 8, many experts with few tokens, awkward dims) and input magnitude / outliers.
    With a `palette` (harness.draw.compile_classes) the shapes come from its compile classes; EP and TP are drawn
    only where they keep the class (up to 65 tokens; I, and H when fully sharded, divisible by the TP size).
    `tp_sizes`: the TP sizes drawn where TP can run (one in four a TP 2 case by default)."""
    regime = draw(st.sampled_from(tuple(regimes)))
    shape = _Shape(draw, palette)
    quant = shape.pick("quant", st.sampled_from(tuple(quants)))
    if shape.classed:
        H, I = shape.fixed["H"], shape.fixed["I"]
    elif quant == "int4_g128":
        H, I = draw(_GROUPED_DIMS), draw(_GROUPED_DIMS)
    else:   # 128 as before (the wide-tile paths; gated_fast_experts needs I % 128 == 0), cheap regimes only
        dims = (_dims(max_dim, aligned=(16, 32, 64, 128), min_dim=2) if regime == "base"
                else _dims(min(max_dim, 64), aligned=(16, 32), min_dim=2))
        H, I = draw(dims), draw(dims)
    T = shape.token_count() if shape.classed else None
    small = T is None or T <= EP_MOST_TOKENS
    ep = draw(st.sampled_from((1, 1, 2))) if small else 1
    if shape.classed:
        E, top_k = shape.experts_and_top_k(regime, ep)
    else:
        E, top_k = _experts_and_top_k(draw, regime, ep)
    on_input = top_k == 1 and draw(st.booleans())
    L = shape.pick("max_loras", st.integers(1, 3))
    R = shape.pick("max_rank", st.sampled_from(EXPERT_RANKS))
    tp_ok = quant == "none" and ep == 1 and small and (not shape.classed or I % 2 == 0)
    tp = draw(st.sampled_from(tuple(tp_sizes))) if tp_ok else 1
    fully_sharded = tp > 1 and R % tp == 0 and (not shape.classed or H % tp == 0) and draw(st.booleans())
    I += I % tp                                  # TP shards I; fully-sharded LoRA also shards H and R
    H += H % tp if fully_sharded else 0
    if T is None:   # simulated ranks each run the kernels: past 65 tokens only for one rank
        T = _tokens(draw, regime, max_T, block_edges if tp == 1 and ep == 1 else _upto(block_edges, 64))
    activation, dtype = _act_dtype(draw, activations, dtypes, shape)
    return Case(
        level="expert", T=T, H=H, I=I, E=E, top_k=top_k,
        dtype=dtype, max_loras=L, max_rank=R,
        ranks=_slot_ranks(draw, R, L),
        mapping=draw(st.sampled_from(SINGLE_RANK_MAPPINGS)),
        routing=draw(st.sampled_from(ROUTINGS)),
        shared_a=draw(st.booleans()), shared_b=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)),
        activation=activation, bias=shape.pick("bias", st.booleans()), lora=shape.pick("lora", st.booleans()),
        apply_router_weight_on_input=on_input, quant=quant,
        ep_size=ep, ep_rank=draw(st.integers(0, ep - 1)), tp_size=tp, fully_sharded=fully_sharded,
        **_input_scale(draw, T, dtype == "float16"), call_tokens=_call_tokens(draw, T) if tp == 1 else 0)


# FP8 draws (harness.spec.case.FP8_QUANTS): made only for a backend that claims an FP8 scheme (claimed_cases), so no
# other backend's draws or time change. vLLM quantizes 16-bit activations; the input is plain, or holds
# massive-activation tokens (MASSIVE_OUTLIER_SCALE: where one activation scale for the tensor differs from one
# per token), in float16 at the magnitude its range leaves them
FP8_DTYPES = ("bfloat16", "float16")
FP8_INPUTS = ("plain", "massive")


@st.composite
def fp8_cases(draw, schemes=FP8_QUANTS, dtypes=FP8_DTYPES, max_T=CPU_DRAWS["expert"].max_T,
              max_dim=CPU_DRAWS["expert"].max_dim, activations=EXPERT_ACTIVATIONS):
    """Expert-level cases with FP8 activations: a scheme of `schemes` (fp8_block: H, I of _GROUPED_DIMS), a
    16-bit dtype of `dtypes`, the LoRA mix, biases, router weight on input, an expert_map (EP), plain or massive-
    activation inputs. Free shapes: the compile-class palettes hold no FP8 scheme."""
    scheme = draw(st.sampled_from(tuple(schemes)))
    if scheme == "fp8_block":
        H, I = draw(_GROUPED_DIMS), draw(_GROUPED_DIMS)
    else:
        dims = _dims(max_dim, aligned=(16, 32, 64, 128), min_dim=2)
        H, I = draw(dims), draw(dims)
    T = draw(st.integers(0, max_T))
    ep = draw(st.sampled_from((1, 1, 2)))
    E, top_k = _experts_and_top_k(draw, "base", ep)
    L = draw(st.integers(1, 3))
    R = draw(st.sampled_from(EXPERT_RANKS))
    activation, dtype = _act_dtype(draw, activations, dtypes)
    scale = {}
    if T >= 1 and draw(st.sampled_from(FP8_INPUTS)) == "massive":
        scale = dict(outliers=draw(st.integers(1, min(2, T))), outlier_scale=MASSIVE_OUTLIER_SCALE)
        if dtype == "float16":
            scale["magnitude"] = FP16_MASSIVE_MAGNITUDE
    return Case(
        level="expert", T=T, H=H, I=I, E=E, top_k=top_k, dtype=dtype, max_loras=L, max_rank=R,
        ranks=_slot_ranks(draw, R, L), mapping=draw(st.sampled_from(SINGLE_RANK_MAPPINGS)),
        routing=draw(st.sampled_from(ROUTINGS)), shared_a=draw(st.booleans()), shared_b=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)), activation=activation, bias=draw(st.booleans()),
        lora=draw(st.booleans()), apply_router_weight_on_input=top_k == 1 and draw(st.booleans()), quant=scheme,
        ep_size=ep, ep_rank=draw(st.integers(0, ep - 1)), **scale)


def _split_tokens(draw, T: int, ep: int) -> tuple:
    """T tokens over ep ranks at drawn cut points (a rank may get none)."""
    cuts = sorted(draw(st.lists(st.integers(0, T), min_size=ep - 1, max_size=ep - 1)))
    edges = [0] + cuts + [T]
    return tuple(edges[r + 1] - edges[r] for r in range(ep))


EP_MOST_TOKENS = 65     # every EP (and simulated TP) rank runs its kernels: totals stay at or below 65


@st.composite
def ep_cases(draw, dtypes=DTYPES_DRAWN, max_T=CPU_DRAWS["ep"].max_T, max_dim=CPU_DRAWS["ep"].max_dim,
             activations=EXPERT_ACTIVATIONS, quants=QUANTS, comms=("simulated",), block_edges=BLOCK_EDGES,
             regimes=REGIMES, palette=None):
    """Dispatched expert-parallel cases: 2 or 4 ranks with uneven token counts (0 included; up to max_T/2
    each), E = ep x local experts, the LoRA mix and mapping pattern (by_rank: each adapter used by one
    rank's tokens only); the reach regimes (a total token count across a block boundary, up to 65 as every
    rank runs, cut between the ranks; top_k up to 8; many experts with few tokens) and input magnitude /
    outliers. With a `palette` (an expert-level one of harness.draw.compile_classes) the shapes come from its
    classes (windows up to 65 tokens), the total cut between the ranks at drawn points."""
    regime = draw(st.sampled_from(tuple(regimes)))
    ep = draw(st.sampled_from((2, 4)))
    shape = _Shape(draw, palette, most_tokens=EP_MOST_TOKENS)
    if shape.classed:
        counts = _split_tokens(draw, shape.token_count(), ep)
    elif regime == "boundary" and _upto(block_edges, 64):   # every rank runs: totals up to 65
        counts = _split_tokens(draw, _edge_count(draw, _upto(block_edges, 64)), ep)
    else:
        per_rank = max(1, max_T // 2) if regime == "base" else 2
        counts = tuple(draw(st.lists(st.integers(0, per_rank), min_size=ep, max_size=ep)))
    quant = shape.pick("quant", st.sampled_from(tuple(quants)))
    if shape.classed:
        H, I = shape.fixed["H"], shape.fixed["I"]
    elif quant == "int4_g128":
        H, I = draw(_GROUPED_DIMS), draw(_GROUPED_DIMS)
    else:
        dims = (_dims(min(max_dim, 64), aligned=(16, 32), min_dim=2) if regime != "base"
                else st.one_of(st.sampled_from(ALIGNED_DIMS), st.integers(2, max_dim)))
        H, I = draw(dims), draw(dims)
    if shape.classed:
        E, top_k = shape.experts_and_top_k(regime, ep)
    elif regime == "base":
        E = ep * draw(st.integers(1, 3))
        top_k = draw(st.integers(1, min(E, 4)))
    else:
        E, top_k = _experts_and_top_k(draw, regime, ep)
    L = shape.pick("max_loras", st.integers(1, 3))
    R = shape.pick("max_rank", st.sampled_from(EP_RANKS))
    activation, dtype = _act_dtype(draw, activations, dtypes, shape)
    T = sum(counts)
    return Case(
        level="expert", T=T, H=H, I=I, E=E, top_k=top_k, dtype=dtype,
        max_loras=L, max_rank=R,
        ranks=_slot_ranks(draw, R, L),
        mapping=draw(st.sampled_from(DISPATCHED_MAPPINGS)),
        routing=draw(st.sampled_from(ROUTINGS)), shared_a=draw(st.booleans()),
        shared_b=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)),
        activation=activation, bias=shape.pick("bias", st.booleans()), lora=shape.pick("lora", st.booleans()),
        apply_router_weight_on_input=top_k == 1 and draw(st.booleans()), quant=quant,
        ep_size=ep, ep_tokens=counts, ep_comm=draw(st.sampled_from(tuple(comms))),
        **_input_scale(draw, T, dtype == "float16"))


# How a campaign draws shapes: "free" (every size), "classes" (the compile-class palette), "auto" (classes on a
# GPU, where a new shape costs a Triton compile; free elsewhere, as the interpreter compiles nothing).
PALETTE_CHOICES = ("auto", "free", "classes")


def wants_compile_classes(palette: str, device: str) -> bool:
    if palette not in PALETTE_CHOICES:
        raise ValueError(f"palette must be one of {PALETTE_CHOICES}; got {palette!r}")
    return palette == "classes" or (palette == "auto" and on_gpu(device))


def claimed_cases(spec, device: str, level: str, compile_classes: bool = False, **sizes):
    """Cases of `level` (op, expert, "ep": dispatched expert-parallel only, or "tp": simulated TP ranks only)
    that `spec` claims on `device`:
    drawn over its declared dtypes, layouts, activations and quant schemes, then filtered by its whole
    declaration (rules included, so nothing it declines runs). `compile_classes`: shapes from the backend's
    compile-class palette (harness.draw.compile_classes: the kernel cache is reused on a GPU), the rest as ever.
    At the expert level a backend that claims an FP8 scheme also gets `fp8_cases`, one draw in four, in free
    shapes, classed campaign or not (the palettes hold no FP8 class; the FP8 kernels compile per scheme and K's
    evenness, a few keys); a backend that claims nothing but FP8 has no palette, and every draw is an FP8 one."""
    v = declared_values(spec, device)
    if not v["dtypes"]:
        return st.nothing()
    claimed = lambda c: support_for(spec, c, device)[0]   # noqa: E731
    fp8_dtypes = tuple(d for d in v["dtypes"] if d in FP8_DTYPES)
    fp8 = None
    if level == "expert" and v["fp8"] and fp8_dtypes:
        fp8 = fp8_cases(schemes=v["fp8"], dtypes=fp8_dtypes, activations=v["activations"], **sizes)
        if not v["plain_quants"]:
            return fp8.filter(claimed)
    palette = None
    if compile_classes:
        at = {**draw_sizes("cpu", "op" if level == "op" else "expert"), **sizes}   # the small profile
        palette = palette_of(spec, device, level, at["max_T"], at["max_dim"])
        if not palette.classes:
            return st.nothing()
    if level == "op":
        base = op_cases(dtypes=v["dtypes"], layouts=v["layouts"], palette=palette, **sizes)
    else:
        kw = dict(dtypes=v["dtypes"], activations=v["activations"], quants=v["quants"], palette=palette)
        if level == "ep":       # dispatched expert parallelism (expert-level cases with ep_tokens)
            base = ep_cases(**kw, **sizes)
        elif level == "tp":     # simulated tensor-parallel ranks (plain or fully-sharded LoRA) only
            base = expert_cases(**kw, **sizes, tp_sizes=(2,)).filter(lambda c: c.tp_size > 1)
        else:
            base = expert_cases(**kw, **sizes)
            if spec.capabilities.expert_parallel:   # one case in four dispatched, so fuzzing reaches EP too
                base = st.one_of(base, base, base, ep_cases(**kw, **sizes))
            if fp8 is not None:   # free-shaped in a classed campaign too: an FP8 GEMM's compile key follows the
                base = st.one_of(base, base, base, fp8)   # scheme and K's evenness only (a few compiles)
    return base.filter(claimed)
