"""Named case families ("features"): the rows of the check matrix and the ids of the conformance suite.

Each feature is data: a name, a level and a function from (index, device profile) to a Case. The same
list drives `moe-lora-harness check` and `suites/test_conformance.py`, so the matrix and pytest agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moe_lora_harness.harness.case import Case
from moe_lora_harness.reference.activations import SUPPORTED_ACTIVATIONS


@dataclass(frozen=True)
class Sizes:
    """Shape scale for a device: small under the Triton interpreter, real on a GPU."""

    T: int
    H: int
    I: int
    E: int
    top_k: int
    max_rank: int
    dtype: str


SMALL = Sizes(T=6, H=64, I=48, E=4, top_k=2, max_rank=8, dtype="float16")
LARGE = Sizes(T=96, H=512, I=384, E=16, top_k=4, max_rank=32, dtype="bfloat16")


SIZES_ENV = "MOE_LORA_HARNESS_SIZES"   # small | large: override the per-device default


def sizes_for(device: str) -> Sizes:
    """SMALL under the interpreter, LARGE on a GPU, unless MOE_LORA_HARNESS_SIZES says otherwise."""
    import os
    forced = os.environ.get(SIZES_ENV, "")
    if forced:
        if forced not in ("small", "large"):
            raise ValueError(f"{SIZES_ENV} must be 'small' or 'large'; got {forced!r}")
        return LARGE if forced == "large" else SMALL
    return LARGE if str(device).startswith("cuda") else SMALL


@dataclass(frozen=True)
class Feature:
    name: str
    level: str
    make: Callable[[Sizes], dict]     # Case fields on top of the base for these sizes
    note: str = ""

    def cases(self, device: str, n: int) -> list[Case]:
        """`n` cases (distinct seeds) for this feature on `device`."""
        s = sizes_for(device)
        base = dict(level=self.level, T=s.T, H=s.H, I=s.I, E=s.E, top_k=s.top_k, max_rank=s.max_rank,
                    dtype=s.dtype, max_loras=3, mapping="uniform")
        fields = dict(base, **self.make(s))
        return [Case(**dict(fields, seed=1000 * (i + 1) + _stable(self.name))) for i in range(n)]


def _stable(name: str) -> int:
    return sum(ord(c) * (i + 1) for i, c in enumerate(name)) % 997


def _w2(s):
    return dict(which="w2", num_slices=1, mul_routed_weight=True)


OP_FEATURES = (
    Feature("fp16", "op", lambda s: dict(dtype="float16")),
    Feature("bf16", "op", lambda s: dict(dtype="bfloat16")),
    Feature("fp32", "op", lambda s: dict(dtype="float32")),
    Feature("sorted layout", "op", lambda s: dict(layout="sorted")),
    Feature("naive layout", "op", lambda s: dict(layout="naive")),
    Feature("small batch (naive, T*k*R<=1024)", "op", lambda s: dict(layout="naive", T=2, max_rank=16)),
    Feature("w2: mul_routed_weight", "op", _w2),
    Feature("w13 one slice (non-gated)", "op", lambda s: dict(num_slices=1)),
    Feature("offset != 0", "op", lambda s: dict(_w2(s), offset=s.H // 2 + 3)),
    Feature("add_inputs=False", "op", lambda s: dict(add_inputs=False)),
    Feature("tokens without adapter (-1)", "op", lambda s: dict(mapping="mixed")),
    Feature("all tokens -1", "op", lambda s: dict(mapping="none")),
    Feature("disabled slot", "op", lambda s: dict(mapping="disabled")),
    Feature("shared LoRA A", "op", lambda s: dict(shared_a=True)),
    Feature("shared LoRA B (w2)", "op", lambda s: dict(_w2(s), shared_b=True)),
    Feature("rank padding (adapter rank < max)", "op", lambda s: dict(ranks=(1, s.max_rank // 2, s.max_rank))),
    Feature("rank 1", "op", lambda s: dict(max_rank=1)),
    Feature("rank 128", "op", lambda s: dict(max_rank=128, T=max(2, s.T // 2))),
    Feature("rank 256 (two-kernel)", "op", lambda s: dict(max_rank=256, T=max(2, s.T // 2))),
    Feature("K, N not multiples of 8", "op", lambda s: dict(H=s.H - 27, I=s.I - 13)),
    Feature("T*k < E", "op", lambda s: dict(T=1, E=4 * s.E)),
    Feature("empty batch", "op", lambda s: dict(T=0)),
    Feature("skewed routing", "op", lambda s: dict(routing="skewed", mapping="skewed", T=2 * s.T)),
    Feature("block size 64", "op", lambda s: dict(block_size_m=64)),
    Feature("expert_map (EP)", "op", lambda s: dict(ep_size=2, ep_rank=1, E=2 * s.E)),
    Feature("fully_sharded (one rank)", "op", lambda s: dict(fully_sharded=True)),
)

ACTIVATION_NAMES = SUPPORTED_ACTIVATIONS   # the reference's list: one feature row each


def _split(T: int, shares) -> tuple:
    """T tokens over len(shares) EP ranks in proportion to `shares` (0 gives a rank no tokens); sums to T."""
    total = sum(shares)
    counts = [T * w // total for w in shares]
    counts[max(range(len(shares)), key=lambda r: shares[r])] += T - sum(counts)
    return tuple(counts)


def _ep(s, ep=2, shares=None, **kw):
    """A dispatched-EP case: ep ranks, each with E experts of its own (E global = ep * E), tokens per `shares`."""
    shares = shares or tuple(range(1, ep + 1))          # uneven by default: 1 : 2 : ... : ep
    T = max(s.T, 12)                                     # enough tokens that every share shows
    return dict(dict(T=T, ep_size=ep, ep_tokens=_split(T, shares), E=ep * s.E), **kw)


def _act(name):
    return Feature(f"experts: {name}", "expert", lambda s: dict(activation=name))


EXPERT_FEATURES = tuple(_act(a) for a in ACTIVATION_NAMES) + (
    Feature("experts: I multiple of 128 (wide-tile paths)", "expert", lambda s: dict(I=128 * max(1, s.I // 128))),
    Feature("experts: base only (no LoRA)", "expert", lambda s: dict(lora=False)),
    Feature("experts: bf16", "expert", lambda s: dict(dtype="bfloat16")),
    Feature("experts: fp32", "expert", lambda s: dict(dtype="float32")),
    Feature("experts: tokens without adapter (-1)", "expert", lambda s: dict(mapping="mixed")),
    Feature("experts: disabled slot", "expert", lambda s: dict(mapping="disabled")),
    Feature("experts: shared LoRA A and B", "expert", lambda s: dict(shared_a=True, shared_b=True)),
    Feature("experts: biases", "expert", lambda s: dict(bias=True, activation="swigluoai")),
    Feature("experts: rank padding", "expert", lambda s: dict(ranks=(1, s.max_rank // 2, s.max_rank))),
    Feature("experts: expert_map (EP)", "expert", lambda s: dict(ep_size=2, ep_rank=0, E=2 * s.E)),
    Feature("experts: router weight on input", "expert", lambda s: dict(top_k=1, apply_router_weight_on_input=True)),
    Feature("experts: non-gated, biases, EP", "expert",
            lambda s: dict(activation="relu2_no_mul", bias=True, ep_size=2, ep_rank=1, E=2 * s.E)),
    Feature("experts: TP 2 (sliced weights, outputs all-reduced)", "expert", lambda s: dict(tp_size=2)),
    Feature("experts: fully-sharded LoRA, TP 2", "expert", lambda s: dict(tp_size=2, fully_sharded=True)),
    Feature("experts: int4 g128", "expert", lambda s: dict(quant="int4_g128", H=128, I=128)),
    Feature("experts: int8 per-channel", "expert", lambda s: dict(quant="int8_channel")),
    # dispatched expert parallelism: every rank runs with its own tokens (harness.ep_ranks)
    Feature("experts: EP 2, dispatch + combine (simulated ranks)", "expert", lambda s: _ep(s, 2)),
    Feature("experts: EP 4, dispatch + combine (simulated ranks)", "expert", lambda s: _ep(s, 4)),
    Feature("experts: EP 2 over processes (gloo on CPU, NCCL on GPUs)", "expert",
            lambda s: _ep(s, 2, ep_comm="processes", mapping="by_rank")),
    Feature("experts: EP uneven batches (1 : 5 : 2 : 0)", "expert", lambda s: _ep(s, 4, (1, 5, 2, 0))),
    Feature("experts: EP rank with no tokens", "expert", lambda s: _ep(s, 2, (0, 1))),
    Feature("experts: EP non-gated (no w3)", "expert", lambda s: _ep(s, 2, activation="relu2_no_mul")),
    Feature("experts: EP adapter used only by another rank", "expert", lambda s: _ep(s, 2, mapping="by_rank")),
    Feature("experts: EP quantized (int8 per-channel)", "expert", lambda s: _ep(s, 2, quant="int8_channel")),
    Feature("experts: EP swigluoai with biases", "expert", lambda s: _ep(s, 2, activation="swigluoai", bias=True)),
    Feature("experts: EP + fully-sharded LoRA (must be refused)", "expert", lambda s: _ep(s, 2, fully_sharded=True),
            note="a backend passes by raising an error that names fully-sharded LoRA, not by running"),
    Feature("experts: EP with E % ep != 0 (must be refused)", "expert", lambda s: dict(_ep(s, 2), E=2 * s.E + 1),
            note="a backend passes by raising an error that names the uneven expert split, not by running"),
)

FEATURES = OP_FEATURES + EXPERT_FEATURES


def feature_cases(features, device: str, n: int):
    """[(feature, index, case)] for every feature."""
    return [(f, i, c) for f in features for i, c in enumerate(f.cases(device, n))]
