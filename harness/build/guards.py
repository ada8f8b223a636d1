"""Guard bands: every tensor handed to a backend lies inside a larger buffer whose surroundings hold poison.

A kernel that reads past an input's end (a tile's tail without its mask, an offset off by one) reads NaN there and
puts it into its output, where the judge fails it ("nonfinite"), instead of reading whatever memory lay beside the
tensor (zeros on a CPU, so such a read passes silently; anything on a GPU). A kernel that writes past any tensor's
end changes a band, which is compared bit for bit after the call ("outside-written"). Integer tensors' bands hold
1 (a valid slot, expert, pair and an enabled flag: a read of them does plausible, wrong work). Built here, handed
over by harness/execution/execute.py; docs/architecture.md says what is guarded and what is not.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

GUARD = 2048                 # elements each side of a tensor's span: more than any tile a kernel reads past an end
GUARD_MAX_BYTES = 2 << 30    # a call whose tensors hold more is handed over unguarded (served shapes on a GPU)
# an input tensor larger than this is watched for writes by its digest (harness.judge.tensor_digest, computed where it
# lies), not by a copy (harness.execution.execute.InputWatch): a served layer's weights (DeepSeek-V3's, 33 GiB with
# their FP8 codes) are not held a third time, so a case that fits twice beside its reference runs
SNAPSHOT_MAX_BYTES = 256 << 20


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype of `dtype`'s size, whose view of a tensor holds its bits (NaN payloads compared as bits;
    every band operation is done on them: FP8 dtypes have no fill or masked_fill)."""
    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]


def _poison_bits(dtype: torch.dtype) -> int:
    """The bands' value as the bits of one element: NaN for floating dtypes, 1 for integers, True for bool."""
    if dtype.is_floating_point:
        return int(torch.tensor([float("nan")]).to(dtype).view(bits_dtype(dtype))[0])
    return 1


def _span(t: torch.Tensor) -> int:
    """Elements from a tensor's first to its last (it has elements, its strides non-negative)."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


@dataclass
class Guarded:
    """A tensor's guarded copy: `view` (same shape, strides and values) inside a buffer (`bits`, its integer
    view); `outside` marks the buffer's elements the view does not cover (the bands, a strided view's gaps)."""

    name: str
    view: torch.Tensor
    bits: torch.Tensor          # the buffer, as integers of the element's size
    outside: torch.Tensor
    poison: int                 # the bands' bits

    def written(self) -> str:
        """'' when every element outside the view still holds the poison, else where it was written."""
        if self.view.is_contiguous():
            # no gaps: the two bands are all there is outside (read alone: a layer's weights are checked every step)
            if not bool((self.bits[:GUARD] != self.poison).any() or (self.bits[-GUARD:] != self.poison).any()):
                return ""
        changed = (self.bits != self.poison) & self.outside
        if not bool(changed.any()):
            return ""
        at = changed.nonzero().flatten()
        before = int((at < GUARD).sum())
        after = int((at >= self.bits.numel() - GUARD).sum())
        inside = at.numel() - before - after
        parts = [f"{n} element(s) {where}" for n, where in ((before, "before its first"), (after, "past its last"),
                                                              (inside, "between its strided elements")) if n]
        return f"{self.name}: " + ", ".join(parts)


def guard(name: str, t: torch.Tensor) -> Guarded | None:
    """A guarded copy of `t`, or None for a tensor that cannot have one (negative strides, no elements)."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0 or any(s < 0 for s in t.stride()):
        return None
    span = _span(t)
    poison = _poison_bits(t.dtype)
    bits = torch.full((span + 2 * GUARD,), poison, dtype=bits_dtype(t.dtype), device=t.device)
    # the span of t's storage, copied whole: a view whose elements share memory (a stride of 0: one LoRA factor
    # for every expert) keeps sharing it; the span's elements t does not cover (gaps of a strided view) are poisoned
    bits[GUARD:GUARD + span] = t.detach().view(bits.dtype).as_strided((span,), (1,), t.storage_offset())
    outside = torch.ones(bits.numel(), dtype=torch.bool, device=t.device)
    outside.as_strided(tuple(t.shape), tuple(t.stride()), GUARD).fill_(False)
    bits.masked_fill_(outside, poison)
    view = bits.view(t.dtype).as_strided(tuple(t.shape), tuple(t.stride()), GUARD)
    return Guarded(name, view, bits, outside, poison)


class Bands:
    """The guarded copies of one call's tensors; `wrap(value)` swaps a tensor (or a list of them) for its copy.
    Off (`enabled` False) for a call whose tensors hold more than GUARD_MAX_BYTES: `guard_fields`."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.guarded: list[Guarded] = []

    def wrap(self, name: str, value):
        if not self.enabled:
            return value
        if isinstance(value, torch.Tensor):
            g = guard(name, value)
            if g is None:
                return value
            self.guarded.append(g)
            return g.view
        if isinstance(value, list) and _tensors_of(value):
            return [self.wrap(f"{name}[{i}]", v) for i, v in enumerate(value)]
        return value

    def written(self) -> list[str]:
        """Where the backend wrote outside its tensors (one line per tensor it did)."""
        return [w for w in (g.written() for g in self.guarded) if w]


def _tensors_of(value) -> list:
    """The tensors `Bands.wrap` guards in one value: a tensor, or each of a list of tensors."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value):
        return list(value)
    return []


def guard_fields(fields: list[dict], prefixes: list[str]) -> tuple[list[dict], list[Bands]]:
    """Each dict of call fields (one per rank, or one) with its tensors guarded; one decision for all of them (their
    tensors together against GUARD_MAX_BYTES, as harness.build.case_memory counts them). Names carry the prefix."""
    size = sum(t.numel() * t.element_size() for f in fields for v in f.values() for t in _tensors_of(v))
    out, bands = [], []
    for f, prefix in zip(fields, prefixes):
        b = Bands(enabled=size <= GUARD_MAX_BYTES)
        out.append({k: b.wrap(prefix + k, v) for k, v in f.items()})
        bands.append(b)
    return out, bands


def guard_calls(calls: list, prefixes: list[str]) -> tuple[list, list[Bands]]:
    """`guard_fields` for dataclass calls (harness.build.expert_runner.ExpertCall, one per EP or TP rank)."""
    fields, bands = guard_fields([{f.name: getattr(c, f.name) for f in dataclasses.fields(c)} for c in calls],
                                 prefixes)
    return [dataclasses.replace(c, **f) for c, f in zip(calls, fields)], bands


def written_outside(bands) -> list[str]:
    """Every line of `bands` (Bands or ReportedBands) saying where a backend wrote outside its tensors."""
    return [w for b in bands for w in b.written()]


def outside_message(who: str, lines: list[str], when: str) -> str:
    """The failure `outside-written`'s text: who wrote where, and how the bands saw it (`when`: after what)."""
    return (f"{who} wrote outside its tensors: {'; '.join(lines)} (every tensor it is handed lies between guard "
            f"bands of {GUARD} elements, compared bit for bit after {when})")


@dataclass
class ReportedBands:
    """Band writes found elsewhere (an EP rank's process guards its own call and reports them), read as Bands are."""

    lines: list

    def written(self) -> list[str]:
        return list(self.lines)
