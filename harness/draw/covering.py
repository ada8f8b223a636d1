"""Pairwise (all-pairs) covering designs for `check`: few cases such that every PAIR of values of the risky
axes meets in at least one of them.

A bug that needs two settings together (naive layout with padded ranks, fp32 with an offset, a disabled slot
under an expert_map ...) is missed by one-feature-at-a-time rows; testing every combination is far too
many cases; a pairwise design meets every pair in about |largest axis| x |second largest| cases. The
construction is a deterministic greedy (AETG-like: each new row starts from one of the hardest uncovered
pairs and fills the other axes with the values covering the most uncovered pairs), with no dependency.

A design is abstract (axis -> value names); `op_fields` / `expert_fields` turn row i into Case fields for a
size profile (small shapes under the interpreter), and `classify_op` / `classify_expert` read the values
back from a Case, so a test can check that the cases themselves (not only the rows) meet every pair. Pairs
that cannot meet are left out, each with its reason (`excluded_pairs`): the ones whose Case is malformed
(Case.problems()) and the ones the model has no such call for (MODEL_RULES).

`harness.check.features` turns every row into a check row ("pairwise op #i", "pairwise expert #i").
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

from moe_lora_harness.harness.draw.axes import (AXES, GATED_TURNS, NON_GATED_TURNS, SINGLE_RANK_MAPPINGS, split_tokens,
                                           values_of)
from moe_lora_harness.harness.spec.case import CLAMP_MAGNITUDE, DTYPES, LAYOUTS, OUTLIER_TOKENS, WHICH, Case
from moe_lora_harness.harness.draw.profiles import SMALL


@dataclass(frozen=True)
class DesignAxis:
    """An axis of a design: its name (an axis of harness.draw.axes) and the values a row takes, in the order the
    greedy construction prefers them (its ties go to the earliest)."""

    name: str
    values: tuple
    note: str = ""


def _last(values, *last) -> tuple:
    """`values` with `last` moved to the end: the order a design visits them in (its rows follow from it)."""
    return tuple(v for v in values if v not in last) + last


def _axis(name: str, values=None, note: str = "") -> DesignAxis:
    """The design axis over the harness.draw.axes axis `name`: its class labels, or `values` (its raw values)."""
    return DesignAxis(name, AXES[name].values if values is None else values, note or AXES[name].note)


MAPPING_ORDER = _last(SINGLE_RANK_MAPPINGS, "skewed")
DTYPE_ORDER = _last(DTYPES, "bfloat16")     # bf16 only where the size profile's device has it
OP_AXES = (
    _axis("mapping", MAPPING_ORDER, "token -> LoRA slot pattern"),
    _axis("rank_class"),
    _axis("align", note="K / N: multiples of 64, of 8 but not 16, odd"),
    _axis("dtype", DTYPE_ORDER, "bf16 only where the size profile's device has it"),
    _axis("token_edge"),
    _axis("layout", LAYOUTS, "sorted (align) or naive (one pair per program) block assignment"),
    _axis("slices", (1, 2), "w13 output slices"),
    _axis("which", WHICH, "w2: x is (T*k, I), N = H, mul_routed_weight"),
    _axis("offset", note="column offset into the output"),
    _axis("add_inputs", (True, False)),
    _axis("ep", AXES["ep"].values[:2], "EP: an expert_map (ep 2, rank 1)"),
)

EXPERT_AXES = (
    _axis("mapping", MAPPING_ORDER, "token -> LoRA slot pattern"),
    _axis("activation_class", note="gated / non-gated rows take the next activation of their class in turn"),
    _axis("ep", note="none, one rank's expert_map, dispatched ranks (2)"),
    _axis("dtype", DTYPE_ORDER, "bf16 only where the size profile's device has it"),
    _axis("input", note="hidden states x 1, x 8 (past the clamps), 2 tokens x 30"),
    _axis("lora", (True, False)),
    _axis("bias", (True, False)),
    _axis("token_edge", AXES["token_edge"].values[:2], "T <= 12 or one past a 16-row block"),
)

# Pairs the model has no call for (Case.problems() accepts them, but the case would not realise both values).
MODEL_RULES = (
    (("which", "w2"), ("slices", 2), "w2 has one output slice in vLLM (the H-wide down projection)"),
)


# -- size profiles -------------------------------------------------------------------------------------------

def _dtype(value: str, s) -> str:
    """The row's dtype on this profile: bf16 becomes fp32 where the profile's device has no bf16 (the
    interpreter), so every other pair of the row still runs."""
    return value if value in s.dtypes else "float32"


def _tokens(value: str, s, i: int) -> int:
    if value == "few":
        return 3 + i % 6          # 3..8 (decode-sized batches; on a GPU too)
    return s.past_blocks[0 if value == "block+1" else 1]     # 17 / 33; GPU 129 / 257


def _align(value: str, s) -> tuple:
    if not s.small:
        return {"aligned64": (512, 384), "mult8": (520, 392), "odd": (509, 381)}[value]
    return {"aligned64": (64, 64), "mult8": (40, 24), "odd": (37, 29)}[value]


def op_fields(row: dict, s, i: int = 0) -> dict:
    """Case fields (on top of a feature's base) of op row `row` on size profile `s`; `i` (row number + case
    index) varies what the row leaves free (a few tokens: T = 3..8)."""
    H, I = _align(row["align"], s)
    R = {"1": 1, "mid": 16, "64+": 64 if s.small else 128, "padded": 16}[row["rank_class"]]
    f = dict(level="op", H=H, I=I, E=s.E, top_k=s.top_k, max_loras=3, max_rank=R,
             ranks=(1, R // 2, R) if row["rank_class"] == "padded" else (),
             dtype=_dtype(row["dtype"], s), T=_tokens(row["token_edge"], s, i), layout=row["layout"],
             mapping=row["mapping"], add_inputs=row["add_inputs"],
             offset=0 if row["offset"] == "0" else (5 if s.small else 37))
    if row["layout"] == "naive" and row["token_edge"] != "few" and s.small:
        f["top_k"] = 1      # naive: one interpreted program per (token, slot); T past a block is the point here
    if row["which"] == "w2":
        f.update(which="w2", num_slices=1, mul_routed_weight=True)
    else:
        f.update(which="w13", num_slices=row["slices"])
    if row["ep"] == "expert_map":
        f.update(ep_size=2, ep_rank=1, E=2 * s.E)
    return f


def expert_fields(row: dict, s, i: int = 0, k: int = 0) -> dict:
    """Case fields of expert row `row` on profile `s`; `i` (row number + case index) varies what the row leaves
    free (T, H); `k` = how many earlier rows had the same activation class (the activation taken in turn)."""
    act = {"gated": GATED_TURNS[k % len(GATED_TURNS)], "non-gated": NON_GATED_TURNS[k % len(NON_GATED_TURNS)],
           "swigluoai": "swigluoai"}[row["activation_class"]]
    T = _tokens(row["token_edge"], s, i)
    if row["ep"] == "dispatched":
        T = max(T, 4)
    H = (64, 48, 40, 56)[i % 4] if s.small else s.H
    I = 32 if s.small else s.I
    f = dict(level="expert", H=H, I=I, E=s.E, top_k=s.top_k, max_loras=3, max_rank=s.max_rank, T=T,
             dtype=_dtype(row["dtype"], s), activation=act, lora=row["lora"], bias=row["bias"],
             mapping=row["mapping"])
    if row["input"] == "magnitude":
        f["magnitude"] = CLAMP_MAGNITUDE
    elif row["input"] == "outliers":
        f["outliers"] = OUTLIER_TOKENS
    if row["ep"] == "expert_map":
        f.update(ep_size=2, ep_rank=i % 2, E=2 * s.E)
    elif row["ep"] == "dispatched":
        f.update(ep_size=2, ep_tokens=split_tokens(T, (1, 2)), E=2 * s.E)
    return f


# -- reading the values back from a case ----------------------------------------------------------------------

def classify_op(c: Case) -> dict:
    """The OP_AXES values a case realises (its dtype as is: a bf16 row run as fp32 reads as fp32)."""
    return values_of(c, [ax.name for ax in OP_AXES])


def classify_expert(c: Case) -> dict:
    return values_of(c, [ax.name for ax in EXPERT_AXES])


# -- the construction -----------------------------------------------------------------------------------------

def _pairs(axes):
    """Every pair ((axis a, value), (axis b, value)), a before b in `axes`; hardest first (the pairs of the
    largest axes, whose count bounds the design from below)."""
    out = []
    for a, b in itertools.combinations(range(len(axes)), 2):
        for v, w in itertools.product(axes[a].values, axes[b].values):
            out.append(((axes[a].name, v), (axes[b].name, w)))
    size = {ax.name: len(ax.values) for ax in axes}
    return sorted(out, key=lambda p: -size[p[0][0]] * size[p[1][0]])


def _case_problems(fields_of, axes, row: dict, s) -> list:
    full = {ax.name: row.get(ax.name, ax.values[0]) for ax in axes}
    try:
        return Case(**dict(fields_of(full, s), seed=0)).problems()
    except (TypeError, ValueError) as e:   # a field the profile cannot build
        return [str(e)]


def _excluded(fields_of, axes, s) -> dict:
    """{pair: reason} for the pairs that cannot meet (MODEL_RULES; Case.problems() of the pair on neutral
    values of the other axes)."""
    names = {ax.name for ax in axes}
    out = {}
    for (a, v), (b, w), why in MODEL_RULES:
        if a in names and b in names:
            out[tuple(sorted(((a, v), (b, w)), key=lambda p: [x.name for x in axes].index(p[0])))] = why
    for pair in _pairs(axes):
        if pair in out:
            continue
        probs = _case_problems(fields_of, axes, dict(pair), s)
        if probs:
            out[pair] = "; ".join(probs)
    return out


def all_pairs(axes, excluded: dict, row_ok, seeds: int = 8, unmet: list | None = None,
              balance: bool = False) -> list[dict]:
    """A deterministic greedy pairwise design over `axes`: rows (axis -> value) such that every pair not in
    `excluded` is in some row; `row_ok(row)` vetoes a full row (higher-order conflicts). Each row is the best
    of `seeds` candidates, each grown from one of the first `seeds` uncovered pairs (hardest first). A pair no
    valid row can hold raises, unless `unmet` is given: then it is appended there and the design goes on.
    `balance`: where values tie, take the one whose pairs with the row's values so far the rows hold least
    (else the axis's earliest), so each pair turns up about equally often (harness.draw.compile_classes samples
    the rows)."""
    order = [ax.name for ax in axes]
    values = {ax.name: ax.values for ax in axes}
    uncovered = [p for p in _pairs(axes) if p not in excluded]
    bad = set(excluded)
    rows = []

    def key(x, y):
        return (x, y) if order.index(x[0]) < order.index(y[0]) else (y, x)

    def gain(row, name, v, todo):
        return sum(1 for m, w in row.items() if key((name, v), (m, w)) in todo)

    def compatible(row, name, v):
        return all(key((name, v), (m, w)) not in bad for m, w in row.items())

    fill_order = sorted(order, key=lambda n: -len(values[n]))
    used: dict = {}    # pair -> rows holding it (balance)

    def worn(row, name, v):
        return sum(used.get(key((name, v), (m, w)), 0) for m, w in row.items())
    while uncovered:
        todo = set(uncovered)
        best = None
        for seed_pair in uncovered[:seeds]:
            row = dict(seed_pair)
            for name in fill_order:
                if name in row:
                    continue
                options = [v for v in values[name] if compatible(row, name, v)] or list(values[name])
                # most new pairs with the values fixed so far; ties: the value in the most uncovered pairs
                row[name] = max(options, key=lambda v: (gain(row, name, v, todo),
                                                        sum(1 for p in uncovered if (name, v) in p),
                                                        -worn(row, name, v) if balance else 0,
                                                        -values[name].index(v)))
            if not row_ok(row):
                continue
            covered = sum(1 for p in itertools.combinations(sorted(row.items(), key=lambda kv: order.index(kv[0])), 2)
                          if p in todo)
            if best is None or covered > best[0]:
                best = (covered, row)
        if best is None:   # every candidate vetoed: give up on the first pair, reported as uncovered
            if unmet is None:
                raise ValueError(f"no valid row covers {uncovered[0]}; add it to MODEL_RULES with its reason")
            unmet.append(uncovered.pop(0))
            continue
        row = {n: best[1][n] for n in order}
        rows.append(row)
        for p in itertools.combinations(row.items(), 2):
            used[p] = used.get(p, 0) + 1
        done = set(itertools.combinations(row.items(), 2))
        uncovered = [p for p in uncovered if p not in done]
    return rows


@dataclass(frozen=True)
class Design:
    level: str
    axes: tuple
    rows: tuple              # dicts axis -> value
    excluded: dict           # pair -> reason

    def fields(self, i: int, s, index: int = 0) -> dict:
        row = self.rows[i]
        if self.level == "op":
            return op_fields(row, s, i + index)
        k = sum(1 for r in self.rows[:i] if r["activation_class"] == row["activation_class"])
        return expert_fields(row, s, i + index, k)

    def describe(self, i: int) -> str:
        return " ".join(f"{n}={v}" for n, v in self.rows[i].items())


def _reference_sizes():
    """The profile validity is judged on (the small one, every dtype allowed): pairs are profile-independent."""
    return dataclasses.replace(SMALL, dtypes=DTYPES)


# candidates per row: the greedy's row count varies with it (a few rows either way); these gave the fewest rows
# over 1..32 (op 20 = the lower bound 5 x 4; expert 17 against a bound of 15). suites/harness/test_reach.py
# holds the counts, so a change of axes that makes the design grow is seen.
OP_SEEDS = 8
EXPERT_SEEDS = 7


@functools.lru_cache(maxsize=None)
def op_design() -> Design:
    s = _reference_sizes()
    excluded = _excluded(op_fields, OP_AXES, s)
    rows = all_pairs(OP_AXES, excluded, lambda r: not _case_problems(op_fields, OP_AXES, r, s), seeds=OP_SEEDS)
    return Design("op", OP_AXES, tuple(rows), excluded)


@functools.lru_cache(maxsize=None)
def expert_design() -> Design:
    s = _reference_sizes()
    excluded = _excluded(expert_fields, EXPERT_AXES, s)
    rows = all_pairs(EXPERT_AXES, excluded, lambda r: not _case_problems(expert_fields, EXPERT_AXES, r, s),
                     seeds=EXPERT_SEEDS)
    return Design("expert", EXPERT_AXES, tuple(rows), excluded)


def design(level: str) -> Design:
    return op_design() if level == "op" else expert_design()


def uncovered_pairs(cases, axes, classify, excluded=None) -> list:
    """The pairs of values of `axes` that no case in `cases` realises (read back with `classify`), less
    `excluded` and less the values no case could take (bf16 on a profile without it)."""
    seen = set()
    for c in cases:
        got = classify(c)
        seen.update(itertools.combinations([(ax.name, got[ax.name]) for ax in axes], 2))
    return [p for p in _pairs(axes) if p not in seen and p not in (excluded or {})]


def lower_bound(axes) -> int:
    """No pairwise design has fewer rows than the product of the two largest axes."""
    a, b = sorted((len(ax.values) for ax in axes), reverse=True)[:2]
    return a * b
