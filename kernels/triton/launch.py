"""Host-side launch helpers the Triton kernels share: tile arithmetic, the pairs-per-bucket statistic and the
cost model the launch heuristics read, slice grouping, and `launch` (a retry with fewer pipeline stages when
a compiled config does not fit the device)."""
from __future__ import annotations

from dataclasses import dataclass

from triton.runtime.errors import OutOfResources

from moe_lora_harness.op_contract.call import OpCall


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def bucket_stats(call: OpCall) -> tuple[float, float]:
    """(expected non-empty (LoRA, expert) buckets, mean pairs per non-empty bucket), uniform routing."""
    P = call.num_pairs
    buckets = max(1, call.num_experts) * max(1, min(call.max_loras, call.num_active))
    nonempty = buckets * (1.0 - (1.0 - 1.0 / buckets) ** P) if buckets > 1 else 1.0
    nonempty = max(1.0, min(nonempty, float(P)))
    return nonempty, P / nonempty


def block_k_for(K: int) -> int:
    """K tile: 128 when K is large, else the smallest power of two covering K (>= 16)."""
    return 128 if K >= 128 else max(16, next_pow2(K))


@dataclass(frozen=True)
class CostModel:
    """The N-split cost model's constants (each kernel fits its own to H200 sweeps): a program streams its
    bytes at `program_bw`; `slots_per_sm` programs run at once per SM; the shrinks, repeated once per N
    split, are bounded by `l2_bw`."""

    program_bw: float
    slots_per_sm: int
    l2_bw: float

    def time(self, shrink: float, expand: float, n_split: int, progs: float, sm: int, split_k: int = 1) -> float:
        """Modelled launch time: each program streams shrink / split_k + expand / n_split (in waves of
        slots_per_sm * sm programs), or the L2 bound on all programs' shrink reads, whichever is slower."""
        waves = max(1.0, progs / (self.slots_per_sm * sm))
        return max((shrink / split_k + expand / n_split) / self.program_bw * waves,
                   progs / split_k * shrink / self.l2_bw)


_FALLBACK_STAGES: dict = {}


def launch(kernel, grid, args, meta: dict, num_warps: int, num_stages: int, key, maxnreg: int = 0) -> None:
    """Launch; if the compiled config does not fit the device (OutOfResources), retry with fewer stages."""
    stages = _FALLBACK_STAGES.get(key, num_stages)
    extra = dict(maxnreg=maxnreg) if maxnreg else {}
    while True:
        try:
            kernel[grid](*args, **meta, num_warps=num_warps, num_stages=stages, **extra)
            return
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
            _FALLBACK_STAGES[key] = stages


def slice_pairs(n: int):
    """Split slice indices 0..n-1 into launches of at most two slices: [(first, count), ...]."""
    return [(s, min(2, n - s)) for s in range(0, n, 2)]
