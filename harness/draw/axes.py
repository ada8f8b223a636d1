"""The axes of a case, one table: signatures, pairwise designs, compile classes, strategies and reports read it.

An axis names the Case fields it reads, how a case's value on it is read (`of`: a value, or the label of a
class of values) and how a case is set back to the plain value (`plain`: Case's defaults, read from the
dataclass). Classes of values have one set of labels, with the sizes that stand for them (`members`).
docs/architecture.md ("The axis and profile tables") says how to add a variant.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moe_lora_harness.harness.spec.case import DTYPES, FP8_QUANTS, LAYOUTS, LEVELS, MAPPINGS, QUANTS, Case
from moe_lora_harness.harness.draw.profiles import PROFILES, on_gpu
from moe_lora_harness.reference.activations import OAI_LIMIT, SUPPORTED_ACTIVATIONS, is_gated

DEFAULT = Case()                                   # the plain value of every field: Case's defaults


def bucket(n: int, edges, least: int = 0) -> str:
    """The bucket of n >= `least` among `edges` (upper bounds, inclusive), as text: "1", "2-16", ">64"."""
    lo = least
    for e in edges:
        if n <= e:
            return f"{lo}-{e}" if lo != e else str(e)
        lo = e + 1
    return f">{edges[-1]}"


# -- sizes of a dimension (H, I, K, N) ----------------------------------------------------------------------

@dataclass(frozen=True)
class SizeClass:
    label: str
    holds: Callable[[int], bool]
    members: tuple = ()        # sizes that stand for the class (a compile class rotates through them), smallest first
    note: str = ""


# Cumulative: a multiple of 64 is one of 16 and of 8. A user telling some of these classes apart puts a size
# in the first of them that holds (`dim_class`); "tiny" (a size, not an alignment) goes before them all.
DIM_CLASSES = (
    SizeClass("aligned64", lambda n: n % 64 == 0, (64, 128, 256, 512, 1024), "a multiple of 64"),
    SizeClass("mult16", lambda n: n % 16 == 0, (48, 80, 272, 784), "a multiple of 16"),
    SizeClass("mult8", lambda n: n % 8 == 0, (24, 40, 72, 520), "a multiple of 8"),
    SizeClass("odd", lambda n: n % 2 == 1, (17, 63, 65, 129, 509, 1023), "odd"),
    SizeClass("tiny", lambda n: n < 16, (2, 7, 15), "below 16: less than one tile, whatever its alignment"),
    SizeClass("unaligned", lambda n: True, (), "not a multiple of 8 (nor odd, where odd is told apart)"),
)
_DIM = {c.label: c for c in DIM_CLASSES}
_CLASSIFY_ORDER = ("tiny",) + tuple(c.label for c in DIM_CLASSES if c.label != "tiny")
SIGNATURE_DIMS = ("aligned64", "mult8", "unaligned")            # a signature's K, N, H, I
FINE_DIMS = ("aligned64", "mult16", "mult8", "odd", "unaligned")  # every alignment told apart
PALETTE_DIMS = ("aligned64", "mult16", "mult8", "odd", "tiny")    # the compile classes' H and I
PAIR_DIMS = ("aligned64", "mult8", "odd")                         # the pairwise rows' H and I together


def dim_class(n: int, among=FINE_DIMS) -> str:
    """The class of size n among the labels `among` (tiny first, then the table's order)."""
    return next(label for label in _CLASSIFY_ORDER if label in among and _DIM[label].holds(n))


def dim_members(labels=PALETTE_DIMS) -> tuple:
    """(label, members) of the classes `labels`, in that order."""
    return tuple((label, _DIM[label].members) for label in labels)


# the free draws' sizes either side of the 8 / 16 / 64 multiples kernels tile by (strategies; none aligned64),
# and the aligned ones they draw besides
AWKWARD_DIMS = (7, 15, 17, 24, 40, 48, 63, 65, 72, 80, 88, 127, 129)
ALIGNED_DIMS = (16, 32, 64)


# -- tokens ---------------------------------------------------------------------------------------------------

BLOCK_EDGES = (16, 32, 64, 128)          # block / tile sizes the kernels' token loops step by
FEW_TOKENS = 12                          # a decode-sized batch: 0..12 tokens
BULK_TOKENS = (130, 256)                 # the bulk window, where max_T reaches it (the GPU profile)
TOKEN_EDGES = (0, 16, 64, 128)           # a signature's token buckets


def token_windows(max_T: int) -> tuple:
    """(label, token counts) of a compile class's token axis: a few tokens, either side of each block edge, bulk."""
    out = [("few", tuple(range(0, min(max_T, FEW_TOKENS) + 1)))]
    out += [(f"edge{e}", (e - 1, e, e + 1)) for e in BLOCK_EDGES]
    if max_T >= BULK_TOKENS[0]:
        out.append(("bulk", tuple(range(BULK_TOKENS[0], min(max_T, BULK_TOKENS[1]) + 1))))
    return tuple(out)


def token_edge(T: int) -> str:
    """Where T sits against a profile's block: few, one past a block, one past two (the pairwise rows' token
    axis), else other."""
    if T <= FEW_TOKENS:
        return "few"
    for label, i in (("block+1", 0), ("2blocks+1", 1)):
        if T in {p.past_blocks[i] for p in PROFILES}:
            return label
    return "other"


# -- ranks, top_k, LoRA slots, offsets, blocks, projections ---------------------------------------------------

OP_RANKS = (1, 2, 4, 8, 16, 32, 64)       # the op strategies' max_rank
LARGE_RANKS = (128, 256)                  # past one 64-wide tile (the base regime only)
EXPERT_RANKS = (1, 4, 8, 16, 32)
EP_RANKS = (1, 4, 8, 16)                  # dispatched: every rank runs its kernels
RANK_EDGES = (1, 16, 64)                  # a signature's rank buckets
OP_RANK_CLASSES = (("1", (1,)), ("mid", (8, 16, 32)), ("64", (64,)), ("past64", LARGE_RANKS))
EXPERT_RANK_CLASSES = (("1", (1,)), ("mid", (4, 8, 16)), ("32", (32,)))
TOP_K_EDGES = (1, 4)
TOP_K_CLASSES = tuple((bucket(m[0], TOP_K_EDGES, 1), m) for m in ((1,), (2, 4, 3), (8, 5, 6)))
LORA_SLOT_CLASSES = (("1", (1,)), ("several", (2, 3, 4)))   # max_loras: Triton specializes an int equal to 1
OFFSET_CLASSES = (("0", (0,)), ("nonzero", (3, 17)))        # the output column offset
BLOCK_SIZES_M = (16, 32, 64)
SHAPES = {"w13x2": ("w13", 2), "w13x1": ("w13", 1), "w2": ("w2", 1)}   # which projection, its output slices


def offset_class(c: Case) -> str:
    return "0" if c.offset == 0 else "nonzero"


# -- mapping, expert parallelism, activation, input scale -------------------------------------------------------

# by_rank (each adapter used by one EP rank's tokens only) means something only with dispatched ranks
SINGLE_RANK_MAPPINGS = tuple(m for m in MAPPINGS if m != "by_rank")
# the dispatched draws: by_rank twice as often, no skewed mapping
DISPATCHED_MAPPINGS = ("by_rank",) * 2 + tuple(m for m in SINGLE_RANK_MAPPINGS if m != "skewed")


def ep_class(c: Case) -> str:
    return "dispatched" if c.dispatched else "expert_map" if c.ep_size > 1 else "none"


def split_tokens(T: int, shares) -> tuple:
    """T tokens over len(shares) EP ranks in proportion to `shares` (0 gives a rank no tokens; the remainder to
    the largest share); sums to T."""
    total = sum(shares)
    counts = [T * w // total for w in shares]
    counts[max(range(len(shares)), key=lambda r: shares[r])] += T - sum(counts)
    return tuple(counts)


# gated rows take the registry's gated activations in turn (swigluoai, a class of its own, aside), non-gated rows
# the non-gated ones; swigluoai_uninterleave comes last, the turn the pairwise rows were written with
GATED_TURNS = tuple(sorted((a for a in SUPPORTED_ACTIVATIONS if is_gated(a) and a != "swigluoai"),
                           key=lambda a: a == "swigluoai_uninterleave"))
NON_GATED_TURNS = tuple(a for a in SUPPORTED_ACTIVATIONS if not is_gated(a))


def activation_class(c: Case) -> str:
    return "swigluoai" if c.activation == "swigluoai" else ("gated" if is_gated(c.activation) else "non-gated")


def input_class(c: Case) -> str:
    """plain, magnitude (pre-activations past the clamps, OAI_LIMIT) or outliers."""
    return "outliers" if c.outliers else ("magnitude" if c.magnitude >= OAI_LIMIT else "plain")


def declared_values(spec, device: str) -> dict:
    """The values `spec` declares on `device` for the axes the strategies and palettes draw over: dtypes,
    layouts, activations, quant schemes (empty dtypes: it runs nothing there); `fp8`: the FP8 schemes it claims,
    which only the strategies' FP8 draw takes (harness.draw.strategies.fp8_cases), and `plain_quants`: whether it claims
    any other scheme (else `quants`' "none" is only a default)."""
    cap = spec.capabilities
    dev = "cuda" if on_gpu(device) else str(device)
    acts = tuple(a for a in SUPPORTED_ACTIVATIONS if cap.activations is None or a in cap.activations)
    return dict(dtypes=tuple(d for d in DTYPES if d in cap.dtypes.get(dev, ())),
                layouts=tuple(sorted(cap.layouts)) or LAYOUTS, activations=acts or SUPPORTED_ACTIVATIONS,
                quants=tuple(q for q in QUANTS if q in cap.quant) or ("none",),
                fp8=tuple(q for q in FP8_QUANTS if q in cap.quant),
                plain_quants=any(q in cap.quant for q in QUANTS))


# -- the axes ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Axis:
    """One axis of a case: its value or class label (`of`), the labels of its classes (`values`, plainest first),
    and the case set back to its plain value (`plain`: None where a failure cannot be moved off it)."""

    name: str
    fields: tuple
    of: Callable[[Case], object]
    plain: Callable[[Case], Case] | None = None
    levels: tuple = LEVELS
    values: tuple = ()
    signature: bool = True        # a failure's signature tells its cases apart by it (harness.search.signatures)
    note: str = ""


def _reset(*names):
    """The case with `names` back at Case's defaults."""
    return lambda c: c.replace(**{n: getattr(DEFAULT, n) for n in names})


def _plain_ep(c: Case) -> Case:
    # one rank keeps its local experts (at least top_k); fully-sharded LoRA, refused under dispatched EP, stays off
    return _reset("ep_size", "ep_rank", "ep_tokens", "ep_comm")(c).replace(
        E=max(c.top_k, c.E // c.ep_size), fully_sharded=c.fully_sharded and not c.dispatched)


def _plain_top_k(c: Case) -> Case:
    return c.replace(top_k=DEFAULT.top_k, E=max(c.E, DEFAULT.top_k * c.ep_size),
                     apply_router_weight_on_input=DEFAULT.apply_router_weight_on_input)


def _plain_rank(c: Case) -> Case:
    return c.replace(max_rank=DEFAULT.max_rank, ranks=tuple(min(r, DEFAULT.max_rank) for r in c.ranks))


def _plain_mul(c: Case) -> Case:
    # w2 always multiplies: back to w13 (its plain slices and offset) without the multiply
    if c.which == "w2":
        return _reset("which", "num_slices", "offset", "mul_routed_weight")(c)
    return _reset("mul_routed_weight")(c)


def _rank_class(c: Case) -> str:
    if c.max_rank == 1:
        return "1"
    if c.ranks and len(set(r for r in c.slot_ranks if r)) > 1:
        return "padded"
    return "64+" if c.max_rank >= 64 else "mid"


def _common_class(c: Case) -> str:
    """The alignment class H and I share (of PAIR_DIMS), else other."""
    h, i = dim_class(c.H), dim_class(c.I)
    return h if h == i and h in PAIR_DIMS else "other"


_OP, _EXPERT = ("op",), ("expert",)
AXES = {a.name: a for a in (
    Axis("level", ("level",), lambda c: c.level),
    Axis("dtype", ("dtype",), lambda c: c.dtype, _reset("dtype")),
    Axis("tokens", ("T",), lambda c: bucket(c.T, TOKEN_EDGES), lambda c: c if c.dispatched else _reset("T")(c)),
    Axis("top_k", ("top_k",), lambda c: bucket(c.top_k, TOP_K_EDGES, 1), _plain_top_k),
    Axis("rank", ("max_rank",), lambda c: bucket(c.max_rank, RANK_EDGES, 1), _plain_rank),
    Axis("padded_ranks", ("ranks",), lambda c: bool(c.ranks), _reset("ranks")),
    Axis("mapping", ("mapping",), lambda c: c.mapping, _reset("mapping")),
    Axis("routing", ("routing",), lambda c: c.routing, _reset("routing")),
    Axis("shared", ("shared_a", "shared_b"), lambda c: f"{c.shared_a}/{c.shared_b}", _reset("shared_a", "shared_b")),
    Axis("ep", ("ep_size", "ep_tokens"), ep_class, _plain_ep, values=("none", "expert_map", "dispatched")),
    Axis("fully_sharded", ("fully_sharded",), lambda c: c.fully_sharded, _reset("fully_sharded")),
    # w2 -> w13 keeps the routing-weight multiply (its own axis): a bug of mul_routed_weight found first on w2
    # and first on w13 gets one signature, not "needs which=w2" and "needs mul_routed_weight=True"
    Axis("which", ("which",), lambda c: c.which, _reset("which", "num_slices", "offset"), _OP),
    Axis("layout", ("layout",), lambda c: c.layout, _reset("layout", "active_loras"), _OP),
    Axis("slices", ("num_slices",), lambda c: c.num_slices,
         lambda c: _reset("num_slices")(c) if c.which == "w13" else c, _OP),
    Axis("offset", ("offset",), offset_class, _reset("offset"), _OP, tuple(label for label, _ in OFFSET_CLASSES)),
    Axis("add_inputs", ("add_inputs",), lambda c: c.add_inputs, _reset("add_inputs"), _OP),
    Axis("mul_routed_weight", ("mul_routed_weight",), lambda c: c.mul_routed_weight, _plain_mul, _OP),
    Axis("K", ("H", "I", "which"), lambda c: dim_class(c.K, SIGNATURE_DIMS),
         lambda c: _reset("H" if c.which == "w13" else "I")(c), _OP, SIGNATURE_DIMS),
    Axis("N", ("H", "I", "which"), lambda c: dim_class(c.N, SIGNATURE_DIMS),
         lambda c: _reset("I" if c.which == "w13" else "H")(c), _OP, SIGNATURE_DIMS),
    Axis("block", ("block_size_m",), lambda c: c.block_size_m, _reset("block_size_m"), _OP),
    Axis("active_loras", ("active_loras",), lambda c: c.active_loras, _reset("active_loras"), _OP),
    Axis("activation", ("activation", "bias"), lambda c: c.activation, _reset("activation", "bias"), _EXPERT),
    Axis("gated", ("activation",), lambda c: is_gated(c.activation), _reset("activation"), _EXPERT),
    Axis("lora", ("lora",), lambda c: c.lora, _reset("lora"), _EXPERT),
    Axis("bias", ("bias",), lambda c: c.bias, _reset("bias"), _EXPERT),
    Axis("quant", ("quant",), lambda c: c.quant, _reset("quant"), _EXPERT),
    Axis("tp", ("tp_size",), lambda c: c.tp_size, _reset("tp_size", "tp_rank", "fully_sharded"), _EXPERT),
    Axis("calls", ("call_tokens",), lambda c: c.calls > 1, _reset("call_tokens"), _EXPERT,
         note="the tokens handed over in several calls of one layer (decode steps)"),
    Axis("router_weight_on_input", ("apply_router_weight_on_input",), lambda c: c.apply_router_weight_on_input,
         _reset("apply_router_weight_on_input"), _EXPERT),
    Axis("H", ("H",), lambda c: dim_class(c.H, SIGNATURE_DIMS), _reset("H"), _EXPERT, SIGNATURE_DIMS),
    Axis("I", ("I",), lambda c: dim_class(c.I, SIGNATURE_DIMS), _reset("I"), _EXPERT, SIGNATURE_DIMS),
    # the pairwise designs' classes (harness.draw.covering), read back from their cases
    Axis("rank_class", ("max_rank", "ranks"), _rank_class, values=("1", "mid", "64+", "padded"), signature=False,
         note="rank 1, 2..63, >= 64, or slots of different ranks"),
    Axis("align", ("H", "I"), _common_class, values=PAIR_DIMS, signature=False, note="H and I in one class"),
    Axis("token_edge", ("T",), lambda c: token_edge(c.T), values=("few", "block+1", "2blocks+1"),
         signature=False, note="a few tokens, one past a block, one past two (the profile's block)"),
    Axis("activation_class", ("activation",), activation_class, levels=_EXPERT,
         values=("gated", "non-gated", "swigluoai"), signature=False),
    Axis("input", ("magnitude", "outliers"), input_class, values=("plain", "magnitude", "outliers"), signature=False,
         note="hidden states x 1, past the activations' clamps, or a few outlier tokens"),
)}
SIGNATURE_AXES = tuple(name for name, a in AXES.items() if a.signature)


def values_of(case: Case, names) -> dict:
    """{axis: the case's value on it} for the axes `names` that apply at the case's level."""
    return {n: AXES[n].of(case) for n in names if case.level in AXES[n].levels}
