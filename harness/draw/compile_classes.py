"""Compile classes: a few dozen kernel shapes for fuzzing on a GPU, so the Triton kernel cache is reused.

A palette fixes what the kernels specialize on to a pairwise covering design of classes (every pair of values
meets in some class); the strategies draw one class, then everything else freely. Built per backend and
device from its declaration; the pairs it cannot claim are listed. docs/compile-classes.md says what
recompiles and why bug-finding power is kept.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from moe_lora_harness.harness.draw.axes import (BLOCK_SIZES_M, EXPERT_RANK_CLASSES, LORA_SLOT_CLASSES, OFFSET_CLASSES,
                                           OP_RANK_CLASSES, SHAPES, TOP_K_CLASSES, declared_values, dim_members,
                                           token_windows)
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.contract import support_for
from moe_lora_harness.harness.draw.covering import DesignAxis, _pairs, all_pairs

INTERPRETER_NAIVE_TOKENS = 33           # naive layout under the interpreter: one program per (token, slot)
SEEDS = 8                               # all_pairs candidates per row


@dataclass(frozen=True)
class CompileClass:
    labels: tuple        # ((axis, value label), ...): the class in the design's terms
    fields: dict         # the Case fields the class fixes
    tokens: tuple        # the token counts its window allows

    def describe(self) -> str:
        return " ".join(f"{a}={v}" for a, v in self.labels)


@dataclass(frozen=True)
class Palette:
    level: str
    axes: tuple
    classes: tuple       # CompileClass, the plainest first (shrinking goes to it)
    unmet: tuple         # pairs no claimed class holds (the backend declines one of their values, or both)

    def __len__(self) -> int:
        return len(self.classes)

    def __repr__(self) -> str:     # short: hypothesis prints its strategies' arguments on a failure
        return f"Palette({self.level}: {len(self.classes)} classes, {len(self.unmet)} pairs unmet)"


def _dims(max_dim: int, min_dim: int) -> tuple:
    """The dimension classes (harness.draw.axes) with members in [min_dim, max_dim] (multiples of 64 up to 128
    always: the wide-tile paths need them, as the free draws do)."""
    out = []
    for label, members in dim_members():
        most = max(max_dim, 128) if label == "aligned64" else max_dim
        keep = tuple(m for m in members if min_dim <= m <= most)
        if keep:
            out.append((label, keep))
    return tuple(out)


def _axis(name, entries, note=""):
    """A design axis whose values are labels, and {label: members}."""
    entries = tuple(e if isinstance(e, tuple) else (e, (e,)) for e in entries)
    return DesignAxis(name, tuple(label for label, _ in entries), note), dict(entries)


def op_axes(dtypes, layouts, max_T: int, max_dim: int):
    """The op-level axes and each value's members."""
    pairs = [_axis("dtype", dtypes), _axis("shape", tuple(SHAPES), "w13 with 2 / 1 slices, or w2"),
             _axis("H", _dims(max_dim, 1)), _axis("I", _dims(max_dim, 1)), _axis("rank", OP_RANK_CLASSES),
             _axis("top_k", TOP_K_CLASSES), _axis("layout", layouts), _axis("block_m", BLOCK_SIZES_M),
             _axis("add_inputs", (True, False)), _axis("mul", (True, False), "mul_routed_weight (w2: always)"),
             _axis("loras", LORA_SLOT_CLASSES), _axis("offset", OFFSET_CLASSES), _axis("tokens", token_windows(max_T))]
    return tuple(a for a, _ in pairs), {a.name: m for a, m in pairs}


def expert_axes(dtypes, activations, quants, max_T: int, max_dim: int):
    """The expert-level axes and each value's members."""
    pairs = [_axis("dtype", dtypes), _axis("activation", activations), _axis("H", _dims(max_dim, 2)),
             _axis("I", _dims(max_dim, 2)), _axis("rank", EXPERT_RANK_CLASSES), _axis("top_k", TOP_K_CLASSES),
             _axis("quant", quants), _axis("bias", (True, False)), _axis("lora", (True, False)),
             _axis("loras", LORA_SLOT_CLASSES), _axis("tokens", token_windows(max_T))]
    return tuple(a for a, _ in pairs), {a.name: m for a, m in pairs}


def _pick(members: dict, row: dict, i: int) -> dict:
    """The concrete member of every axis for rotation `i` (member i mod count)."""
    return {n: ms[row[n]][i % len(ms[row[n]])] for n, ms in members.items() if n in row}


def op_fields(v: dict, interpreter: bool) -> dict | None:
    """Case fields of an op class from concrete values `v`; None where the model has no such call."""
    if v["shape"] == "w2" and not v["mul"]:
        return None                      # vLLM's w2 multiplies by the routed weight
    which, slices = SHAPES[v["shape"]]
    T = v["tokens"]
    if interpreter and v["layout"] == "naive" and T > INTERPRETER_NAIVE_TOKENS:
        return None                      # the interpreter runs one program per (token, slot): too slow
    return dict(level="op", dtype=v["dtype"], which=which, num_slices=slices, H=v["H"], I=v["I"],
                max_rank=v["rank"], top_k=v["top_k"], E=max(4, v["top_k"]), layout=v["layout"],
                block_size_m=v["block_m"], add_inputs=v["add_inputs"], mul_routed_weight=v["mul"], T=T,
                max_loras=v["loras"], offset=v["offset"])


def expert_fields(v: dict, interpreter: bool) -> dict | None:
    return dict(level="expert", dtype=v["dtype"], activation=v["activation"], H=v["H"], I=v["I"],
                max_rank=v["rank"], top_k=v["top_k"], E=max(4, v["top_k"]), quant=v["quant"], bias=v["bias"],
                lora=v["lora"], T=v["tokens"], max_loras=v["loras"])


_CLASS_FIELDS = {"op": op_fields, "expert": expert_fields}
_NOT_FIXED = ("level", "T", "E")   # realised for the claim check; the strategy sets level, draws T (the window), E


def build(level: str, claimed, axes, members, interpreter: bool) -> Palette:
    """The palette over `axes`: a pairwise design whose every class `claimed(case)` accepts."""
    to_fields = _CLASS_FIELDS[level]
    spread = max(len(ms) for m in members.values() for ms in m.values())

    judged: dict = {}

    def claimed_case(f: dict) -> bool:
        key = tuple(sorted(f.items()))
        if key not in judged:        # the design asks about the same concrete case many times
            case = Case(**f, seed=0)
            judged[key] = not case.problems() and claimed(case)
        return judged[key]

    def realise(row: dict, i: int):
        """The fields of the first claimed concrete choice (members tried from rotation i on), else None."""
        for j in range(spread):
            f = to_fields(_pick(members, row, i + j), interpreter)
            if f is not None and claimed_case(f):
                return f
        return None

    def holds(pair) -> bool:
        """Some full row with this pair is claimed: the other axes tried at their (k + j)-th and k-th values
        (j: the axis' position, so that axes of equal length do not move in step), k = 0, 1, ..."""
        most = max(len(a.values) for a in axes)
        for k, shift in itertools.product(range(most), (True, False)):
            row = {a.name: a.values[(k + (j if shift else 0)) % len(a.values)] for j, a in enumerate(axes)}
            row.update(dict(pair))
            if realise(row, 0) is not None:
                return True
        return False

    excluded = {p: "no claimed class holds both" for p in _pairs(axes) if not holds(p)}
    unmet = []
    ok = lambda r: realise(r, 0) is not None   # noqa: E731
    # balanced: a value the greedy would leave to a tie goes to the one held least, so each value (and each
    # pair) turns up in the palette about as often as in a free draw, not only in the one class that covers it
    rows = all_pairs(axes, excluded, ok, seeds=SEEDS, unmet=unmet, balance=True)
    order = {a.name: a.values for a in axes}
    rows.sort(key=lambda r: (sum(order[n].index(v) for n, v in r.items()), tuple(map(str, r.values()))))
    classes = []
    for i, row in enumerate(rows):
        f = realise(row, i) or realise(row, 0)
        tokens = members["tokens"][row["tokens"]]
        fixed = {k: v for k, v in f.items() if k not in _NOT_FIXED}
        classes.append(CompileClass(tuple(row.items()), fixed, tokens))
    held = _held(classes)
    unmet = [p for p in sorted(excluded) + unmet if p not in held]   # a pair judged out may have met anyway
    return Palette(level, axes, tuple(classes), tuple(unmet))


def palette_for(spec, device: str, level: str, max_T: int, max_dim: int) -> Palette:
    """The palette of `level` ("op" or "expert") that `spec` claims on `device`, at a size profile."""
    v = declared_values(spec, device)
    claimed = lambda c: support_for(spec, c, device)[0]   # noqa: E731
    interpreter = not str(device).startswith("cuda")
    if level == "op":
        axes, members = op_axes(v["dtypes"], v["layouts"], max_T, max_dim)
    else:
        axes, members = expert_axes(v["dtypes"], v["activations"], v["quants"], max_T, max_dim)
    return build(level, claimed, axes, members, interpreter)


_PALETTES: dict = {}


def palette_of(spec, device: str, level: str, max_T: int, max_dim: int) -> Palette:
    """`palette_for`, built once per (backend, device, level, size profile); the ep level shares the expert
    palette."""
    level = "op" if level == "op" else "expert"
    key = (id(spec), str(device), level, max_T, max_dim)
    if key not in _PALETTES or _PALETTES[key][0] is not spec:
        _PALETTES[key] = (spec, palette_for(spec, device, level, max_T, max_dim))
    return _PALETTES[key][1]


def class_of(case: Case, palette: Palette):
    """The palette's class a case belongs to (its fixed fields match, its T in the window), else None."""
    for c in palette.classes:
        if all(getattr(case, k) == v for k, v in c.fields.items()) and case.T in c.tokens:
            return c
    return None


def _held(classes) -> set:
    return {p for c in classes for p in itertools.combinations(c.labels, 2)}


def value_pairs(palette: Palette) -> set:
    """Every pair of axis values some class of `palette` holds."""
    return _held(palette.classes)
