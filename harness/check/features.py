"""Named case families ("features"): the rows of the check matrix and the ids of the conformance suite.

Each feature is data: a name, a level and a function from (index, device profile) to a Case. The same
list drives `moe-lora-harness check` and `suites/test_conformance.py`, so the matrix and pytest agree.

Besides one row per setting, the reach rows (top_k 8, E 64 with few tokens, a block edge, the swigluoai clamp,
outlier tokens) and the pairwise rows ("pairwise op #i", "pairwise expert #i": harness.draw.covering's designs, in
which every pair of values of the risky axes meets) go where kernels break. On the small (interpreter) profile
the rows the pairwise ones subsume run one case (SUBSUMED_BY_PAIRWISE), to keep the CPU run's time.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from moe_lora_harness.harness.draw.axes import split_tokens
from moe_lora_harness.harness.judge.compare import EXCESS_MIN_ROWS
from moe_lora_harness.harness.spec.case import (CLAMP_MAGNITUDE, FP16_MASSIVE_MAGNITUDE, MASSIVE_OUTLIER_SCALE,
                                           OUTLIER_SCALE, OUTLIER_TOKENS, SUBNORMAL_EXPERT_MAGNITUDE,
                                           SUBNORMAL_OP_MAGNITUDE, Case)
from moe_lora_harness.harness.draw.covering import design
from moe_lora_harness.harness.draw.profiles import Shapes, shapes_for
from moe_lora_harness.reference.activations import SUPPORTED_ACTIVATIONS


DECODE_ROW = "experts: decode calls (the batch in calls of 1 token, then 2; the same layer)"
# the decode row's tokens beyond the small profile, and a served decode's pooled rows (harness.check.model_plan): four
# times the rows rule 4 needs before it can fail at all. A slip that dominates its rows brings rule 4's statistic to
# at most sqrt(n_eff) of the threshold's square, n_eff = (sum s_r)^2 / sum s_r^2 over its rows' squared sizes s_r, and
# a real slip's rows are uneven (0.3-0.85 of n measured): at twice the rows it saturated under the threshold
# (docs/error-model.md, "Decode calls")
DECODE_ROWS = 4 * EXCESS_MIN_ROWS
# with --model, token counts up to this are decode calls (a larger batch is a prefill: its own rows suffice)
DECODE_MOST_TOKENS = 64


@dataclass(frozen=True)
class Feature:
    name: str
    level: str
    make: Callable[[Shapes], dict]     # Case fields on top of the base for these sizes
    note: str = ""
    per_case: Callable[[Shapes, int], dict] | None = None   # case i's own fields, on top of make's
    max_cases: int | None = None      # at most this many cases (a covering row is one point: seeds add no pair)
    vary_h: bool = True               # cases after the first take another H (when make leaves H alone)
    small_cases: int | None = None    # at most this many on the small profile (the interpreter's time)
    # with --model, a token count up to DECODE_MOST_TOKENS is one decode call's, pooled over calls to DECODE_ROWS rows
    # (harness.check.model_plan; the decode row and the FP8 rows): a call that small alone leaves rule 4 silent
    pooled_decode: bool = False

    def case_fields(self, s: Shapes, i: int = 0) -> dict:
        """Case i's fields at the sizes `s`: the base, the feature's own fields, case i's and its seed. Case 0 is the
        feature on `s`; later ones vary H where the feature leaves it free (check's H is not always 64) and
        whatever `per_case` varies. (harness.check.model_plan calls it with a served layer's sizes.)"""
        base = dict(level=self.level, T=s.T, H=s.H, I=s.I, E=s.E, top_k=s.top_k, max_rank=s.max_rank,
                    dtype=s.dtype, max_loras=3, mapping="uniform")
        made = self.make(s)
        fields = dict(base, **made)
        if i and self.vary_h and "H" not in made:
            fields["H"] = _other_h(s, self.name, i)
        if self.per_case is not None:
            fields.update(self.per_case(s, i))
        return dict(fields, seed=1000 * (i + 1) + _stable(self.name))

    def cases(self, device: str, n: int) -> list[Case]:
        """`n` cases (distinct seeds; at most max_cases) for this feature on `device` (`case_fields`)."""
        s = shapes_for(device)
        caps = [c for c in (self.max_cases, self.small_cases if s.small else None) if c is not None]
        return [Case(**self.case_fields(s, i)) for i in range(min([n] + caps))]


def _other_h(s: Shapes, name: str, i: int) -> int:
    """An H other than the profile's for case i >= 1 of a feature (fixed by the feature's name): 3/4, 5/4, 5/8
    or 3/2 of it (small: 48, 80, 40, 96, none a multiple of 64; large: 384, 640, 320, 768)."""
    alts = (s.H * 3 // 4, s.H * 5 // 4, s.H * 5 // 8, s.H * 3 // 2)
    return alts[(_stable(name) + i - 1) % len(alts)]


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
    Feature("num_active_loras = the distinct slots (specialize_active_lora)", "op",
            lambda s: dict(active_loras="unique", mapping="mixed", max_loras=3, layout="sorted")),
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
) + (
    # reach: wide routing, sparse experts, K / N off the 16-multiples (token counts past a block edge, awkward
    # K / N and every other pair of the risky axes meet in the pairwise rows below); one case each when small
    Feature("op: top_k 8, E 16", "op", lambda s: dict(top_k=8, E=16, T=max(3, s.T // 2)), small_cases=1),
    Feature("op: many experts, few tokens (E=64, T=5)", "op", lambda s: dict(E=64, T=5), small_cases=1),
    Feature("op: one token, top-1 (one expert, one block of pairs)", "op", lambda s: dict(T=1, top_k=1),
            small_cases=1, note="the grid's first block is its last: a block-skipping test off by a block skips all"),
    Feature("op: K, N multiples of 8, not of 16", "op", lambda s: dict(H=s.H - 24, I=s.I - 24), small_cases=1),
    Feature("op: K over two K tiles of 128 (273, then 384)", "op",
            lambda s: dict(T=max(2, s.T // 2)), per_case=lambda s, i: dict(H=(273, 384)[i % 2], I=(273, 384)[i % 2]),
            small_cases=1, note="the K loop's pointer advance runs (one tile covers every other row's K on a CPU)"),
    Feature("op: subnormal deltas (float16, x times 2^-20, add_inputs=False)", "op",
            lambda s: dict(dtype="float16", magnitude=SUBNORMAL_OP_MAGNITUDE, add_inputs=False), small_cases=1,
            note="deltas near 1e-6, below float16's smallest normal: gradual underflow, where flush-to-zero shows"),
    Feature("op: subnormal sums (float16, x and the output buffer times 2^-20, add_inputs=True)", "op",
            lambda s: dict(dtype="float16", magnitude=SUBNORMAL_OP_MAGNITUDE, add_inputs=True), small_cases=1,
            note="the prior values and the deltas both subnormal: an op that always accumulates gets a subnormal "
                 "check too"),
)

ACTIVATION_NAMES = SUPPORTED_ACTIVATIONS   # the reference's list: one feature row each


def _ep(s, ep=2, shares=None, **kw):
    """A dispatched-EP case: ep ranks, each with E experts of its own (E global = ep * E), tokens per `shares`."""
    shares = shares or tuple(range(1, ep + 1))          # uneven by default: 1 : 2 : ... : ep
    T = max(s.T, 12)                                     # enough tokens that every share shows
    return dict(dict(T=T, ep_size=ep, ep_tokens=split_tokens(T, shares), E=ep * s.E), **kw)


def _past_block(s: Shapes, i: int) -> int:
    """One token past the profile's block (16 rows; GPU: 128), then past two: 17, 33 (GPU 129, 257)."""
    return s.past_blocks[i % 2]


def _fp8_dtype(s: Shapes, i: int) -> dict:
    """An FP8 row's case i: float16 first (where the interpreter runs Triton; at the magnitude float16's range
    leaves a massive-activation token, FP16_MASSIVE_MAGNITUDE), then bfloat16 (a GPU's --more cases). float16's
    per-element bound sees the ordinary tokens a shared activation scale rounds to zero; in bfloat16 the per-element
    and whole-tensor rules do not, the aggregate rule per token row does (docs/error-model.md, "The aggregate rule
    per row")."""
    return dict(dtype="float16", magnitude=FP16_MASSIVE_MAGNITUDE) if i % 2 == 0 else dict(dtype="bfloat16")


# an FP8 row's input: one massive-activation token (harness.spec.case, MASSIVE_OUTLIER_SCALE: why 2^10)
_MASSIVE_TOKEN = dict(outliers=1, outlier_scale=MASSIVE_OUTLIER_SCALE)
FP8_BLOCK_SIZES = dict(H=256, I=256)   # two 128-wide blocks along both GEMMs' K, where the sizes are not multiples


def _block_sizes(s: Shapes) -> dict:
    """The fp8 block row's H and I: the profile's or the served layer's where both are multiples of the 128-wide
    block (DeepSeek-V3's own scheme at its own layer), else FP8_BLOCK_SIZES (a layer with those is not applicable)."""
    return {} if s.H % 128 == 0 and s.I % 128 == 0 else dict(FP8_BLOCK_SIZES)


def _act(name):
    """One row per activation: its cases take the profile's dtypes in turn (small: fp16, fp32), so every
    activation is tried in fp32 too."""
    return Feature(f"experts: {name}", "expert", lambda s: dict(activation=name),
                   per_case=lambda s, i: dict(dtype=s.dtypes[i % len(s.dtypes)]))


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
    # two groups of 128 along both GEMMs' K: a wrong group index shows (bench/mutation_score.py, thirtieth session)
    Feature("experts: int4 g128", "expert", lambda s: dict(quant="int4_g128", H=256, I=256)),
    Feature("experts: int8 per-channel", "expert", lambda s: dict(quant="int8_channel")),
    # FP8 with quantized activations (reference.fp8): the base GEMMs read e4m3 activations, the LoRA the unquantized
    # (one massive-activation token: a scale shared across tokens, not per token, rounds the others away)
    Feature("experts: fp8 w8a8", "expert", lambda s: dict(quant="fp8_w8a8", **_MASSIVE_TOKEN), per_case=_fp8_dtype,
            small_cases=1, pooled_decode=True,
            note=f"e4m3 weights per channel, activations per token (dynamic), one token "
                 f"x{MASSIVE_OUTLIER_SCALE:g}; float16, then bfloat16; the LoRA reads the unquantized activations; "
                 f"with --model, decode token counts are pooled calls"),
    Feature("experts: fp8 block", "expert", lambda s: dict(quant="fp8_block", **_block_sizes(s), **_MASSIVE_TOKEN),
            per_case=_fp8_dtype, small_cases=1, pooled_decode=True, vary_h=False,
            note=f"DeepSeek-V3's 128x128 weight blocks, activations per token-group of 128 (dynamic), one token "
                 f"x{MASSIVE_OUTLIER_SCALE:g}; float16, then bfloat16; H and I 256 where the profile's or layer's "
                 f"are not multiples of 128; with --model, decode token counts are pooled calls"),
    # dispatched expert parallelism: every rank runs with its own tokens (harness.execution.ep_ranks)
    Feature("experts: EP 2, dispatch + combine (simulated ranks)", "expert", lambda s: _ep(s, 2)),
    Feature("experts: EP 4, dispatch + combine (simulated ranks)", "expert", lambda s: _ep(s, 4)),
    Feature("experts: EP 2 over processes (gloo on CPU, NCCL on GPUs)", "expert",
            lambda s: _ep(s, 2, ep_comm="processes", mapping="by_rank"), small_cases=1,
            note="one case on the CPU profile: every case starts a process per rank (the simulated rows "
                 "run the same layer); --more and the GPU profile run more"),
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
) + (
    # reach: block edges, wide routing, sparse experts, pre-activations past the clamps, outlier tokens
    # (one case each on the small profile: the pairwise expert rows also cross T = 17 and scale the inputs)
    Feature("experts: tokens across a block boundary (T=17, then 33; GPU 129, 257)", "expert", lambda s: {},
            per_case=lambda s, i: dict(T=_past_block(s, i)), small_cases=1),
    Feature("experts: top_k 8, E 16", "expert", lambda s: dict(top_k=8, E=16, T=max(4, s.T * 2 // 3), H=s.H * 3 // 4,
                                                         I=s.I * 2 // 3), small_cases=1),
    Feature("experts: many experts, few tokens (E=64, T=5)", "expert", lambda s: dict(E=64, T=5), small_cases=1),
    Feature("experts: one token, top-1 (one expert, one block of pairs)", "expert", lambda s: dict(T=1, top_k=1),
            small_cases=1, note="the grid's first block is its last: a block-skipping test off by a block skips all"),
    Feature(f"experts: swigluoai at its clamp (magnitude {CLAMP_MAGNITUDE:g}, biases)", "expert",
            lambda s: dict(activation="swigluoai", magnitude=CLAMP_MAGNITUDE, bias=True), small_cases=1,
            note="pre-activations ~ N(0, 8^2): about half pass swigluoai's limit 7"),
    Feature(f"experts: outlier tokens ({OUTLIER_TOKENS} tokens x{OUTLIER_SCALE:g})", "expert",
            lambda s: dict(outliers=OUTLIER_TOKENS), small_cases=1),
    Feature(DECODE_ROW, "expert", lambda s: dict(mapping="mixed", T=max(4, s.T // 2 * 2) if s.small else DECODE_ROWS),
            per_case=lambda s, i: dict(call_tokens=1 + i % 2), small_cases=1, pooled_decode=True,
            note=f"one call per decode step: each call its own tokens and mapping (tokens without an adapter "
                 f"among them), all judged together (rule 4 pools their rows: {DECODE_ROWS} on a GPU, where one call's "
                 f"{EXCESS_MIN_ROWS - 1} or fewer could never fail it); with --model each token count is one call's"),
    Feature("experts: subnormal activations (float16, hidden states times 2^-10)", "expert",
            lambda s: dict(dtype="float16", magnitude=SUBNORMAL_EXPERT_MAGNITUDE), small_cases=1,
            note="a gated activation multiplies two pre-activations near 1e-3: products below float16's smallest "
                 "normal"),
)


# properties (harness.build.properties, docs/semantics.md 10.1): a view of the case judged against the reference and
# against the plain case's run; they set no size, so they run at every model's shape too
PROPERTY_FEATURES = tuple(
    Feature(f"property: {what}", "expert", (lambda s, v=view: dict(view=v, mapping="mixed")), small_cases=1)
    for view, what in (("half", "batch invariance (the first half of the batch alone)"),
                       ("reversed", "token order (the batch reversed)"),
                       ("slots_rotated", "slot relabelling (every adapter one slot on)")))


def _pairwise(level: str) -> tuple:
    """One row per case of the level's pairwise covering design (harness.draw.covering): every pair of values of
    the risky axes meets in one of them. One case each (another seed meets no other pair)."""
    d = design(level)
    label = "op" if level == "op" else "expert"
    return tuple(Feature(f"pairwise {label} #{i + 1}", level, (lambda s, i=i: d.fields(i, s)),
                         note=d.describe(i), max_cases=1, vary_h=False) for i in range(len(d.rows)))


PAIRWISE_OP_FEATURES = _pairwise("op")
PAIRWISE_EXPERT_FEATURES = _pairwise("expert")

# Rows whose one setting is a value of a pairwise axis: the pairwise rows meet it with every value of every
# other axis, so on the small profile (the interpreter's time is the CI's) one case of each is kept, and a
# second seed of theirs is not run; on a GPU they keep all their cases.
SUBSUMED_BY_PAIRWISE = (
    "fp16", "fp32", "sorted layout", "naive layout", "w2: mul_routed_weight", "w13 one slice (non-gated)",
    "offset != 0", "add_inputs=False", "tokens without adapter (-1)", "all tokens -1", "disabled slot",
    "rank padding (adapter rank < max)", "rank 1", "K, N not multiples of 8", "expert_map (EP)",
    "experts: base only (no LoRA)", "experts: fp32", "experts: tokens without adapter (-1)",
    "experts: disabled slot", "experts: biases", "experts: expert_map (EP)",
)


def _one_on_small(features):
    return tuple(dataclasses.replace(f, small_cases=1) if f.name in SUBSUMED_BY_PAIRWISE else f for f in features)


OP_FEATURES = _one_on_small(OP_FEATURES) + PAIRWISE_OP_FEATURES
EXPERT_FEATURES = _one_on_small(EXPERT_FEATURES) + PROPERTY_FEATURES + PAIRWISE_EXPERT_FEATURES
FEATURES = OP_FEATURES + EXPERT_FEATURES


def feature_cases(features, device: str, n: int):
    """[(feature, index, case)] for every feature."""
    return [(f, i, c) for f in features for i, c in enumerate(f.cases(device, n))]
