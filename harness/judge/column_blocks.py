"""Rule 4's column blocks: dyadic blocks of an output row's (flattened) columns, over which the excess over the
emulation is also summed, so that a mistake confined to a few columns (a GEMM tile's N tail, one column block) is
measured against those columns' allowance rather than diluted by the whole row's noise. Which blocks exist follows
the row's width alone, never the output judged. docs/error-model.md, "Rule 4 over column blocks"."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

COLUMN_BLOCK = 8          # the narrowest block, in columns: a tensor-core MMA tile's narrowest N
COLUMN_SETS_MAX = 256     # the narrowest block doubles until about this many blocks of every width remain


@dataclass(frozen=True)
class ColumnBlocks:
    """The blocks of a row `width` columns wide: the narrowest `unit` columns each, `member` (units, blocks)
    float64 0/1 (which units each block holds), `spans` each block's (first, last) column."""

    width: int
    unit: int
    member: torch.Tensor
    spans: tuple

    def sums(self, x: torch.Tensor) -> torch.Tensor:
        """(rows, units): `x` (rows, ...) summed over each unit's columns (its trailing dims flattened)."""
        flat = x.reshape(x.shape[0], -1)
        pad = self.member.shape[0] * self.unit - flat.shape[1]
        if pad:
            flat = torch.nn.functional.pad(flat, (0, pad))
        return flat.reshape(flat.shape[0], -1, self.unit).sum(dim=2)

    def name(self, i: int) -> str:
        lo, hi = self.spans[i]
        return f"columns {lo}-{hi} of every row"


@functools.lru_cache(maxsize=64)
def column_blocks(width: int) -> ColumnBlocks | None:
    """The dyadic blocks of a row of `width` columns narrower than the row (the unit, and each doubling of it, the
    last block of each size cut at the row's end; a block equal to one already listed is listed once); None where
    the row holds fewer than two units. Built once per width (every judgement asks; `member` is never written)."""
    unit = COLUMN_BLOCK
    while 2 * math.ceil(width / unit) > COLUMN_SETS_MAX:
        unit *= 2
    units = math.ceil(width / unit)
    if units < 2:
        return None
    seen, spans, cols = set(), [], []
    size = 1
    while size < units:
        for lo in range(0, units, size):
            hi = min(lo + size, units)
            if (lo, hi) in seen:
                continue
            seen.add((lo, hi))
            spans.append((lo * unit, min(hi * unit, width) - 1))
            col = torch.zeros(units, dtype=torch.float64)
            col[lo:hi] = 1.0
            cols.append(col)
        size *= 2
    return ColumnBlocks(width, unit, torch.stack(cols, dim=1), tuple(spans))
