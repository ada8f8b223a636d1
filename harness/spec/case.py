"""The case model: one frozen record describing a MoE+LoRA test input, round-tripping through JSON.

A case holds structure (shapes, routing skew, LoRA mix, flags, seed), never tensors; `harness.build.builders`
turns it into tensors on a device deterministically.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

LEVELS = ("op", "expert")
DTYPES = ("float16", "bfloat16", "float32")
MAPPINGS = ("uniform", "mixed", "skewed", "none", "disabled", "by_rank")
ROUTINGS = ("uniform", "skewed")
LAYOUTS = ("sorted", "naive")
QUANTS = ("none", "int4_g128", "int8_channel")
# quantized activations too (reference.fp8): e4m3 weights with per-channel / 128x128-block scales, activations per
# token / per token-group of 128, dynamic. Kept out of QUANTS, which the covering designs, palettes and the other
# draws take (harness.draw.axes.declared_values): the feature rows, explicit cases and the strategies' own FP8 draw for a
# backend that claims a scheme (harness.draw.strategies.fp8_cases) reach them; ALL_QUANTS is what a case may hold
FP8_QUANTS = ("fp8_w8a8", "fp8_block")
ALL_QUANTS = QUANTS + FP8_QUANTS
WHICH = ("w13", "w2")
# num_active_loras (the sorted path's grid over lora_ids): "all" = L+1, vLLM's default; "unique" = the count of
# distinct slots in the mapping (-1 included), what specialize_active_lora launches at its smallest
ACTIVE_LORAS = ("all", "unique")
EP_COMMS = ("simulated", "processes")
# a metamorphic view of an expert-level case (harness.build.properties): its inputs are the plain case's, then cut to the
# first half of the tokens, put in reverse token order, with every adapter moved one slot on, or with the hidden and
# intermediate dimensions permuted (every long sum in another order; an op-level case's K alike); "" = the case
VIEWS = ("", "half", "reversed", "slots_rotated", "reordered")
# the weight schemes whose reordered view is built: unquantized, and FP8, whose scale blocks move whole
# (harness.build.properties.view_blocks); packed integer weights would not follow
REORDERED_QUANTS = ("none",) + FP8_QUANTS
# input scale: `magnitude` scales every token's hidden state (op level: the LoRA input x); `outliers` tokens
# are scaled a further `outlier_scale` (default OUTLIER_SCALE), as the massive-activation tokens of real models are
OUTLIER_SCALE = 30.0
# a massive-activation token (FP8 rows and draws): real LLM hidden states hold tokens 10^3-10^4 times the others
# (e.g. the first token; Sun et al. 2024, "Massive activations in large language models"), and e4m3 is where such a
# span matters: under one scale for the tensor (its amax / 448) a token whose own amax lies 448 x 2^10 below the
# tensor's falls under half e4m3's smallest subnormal (2^-9) and rounds to 0. GEMM2 reads the activation's output,
# which a gated (or relu2) activation makes quadratic in the token's size: a span S at the input is S^2 there. The
# smallest power of two with S^2 >= 448 x 2^10 = 2^18.8 is 2^10, the low end of the range real models show
# (docs/semantics.md 9.1; suites/experts/test_fp8.py re-derives it from reference.fp8's e4m3 constants)
MASSIVE_OUTLIER_SCALE = 2.0 ** 10
MAX_MAGNITUDE = 64.0
# a magnitude past the activations' clamps (swigluoai / swiglustep clamp at 7: std-8 pre-activations pass it about
# half the time), and the outlier tokens of a row that has them
CLAMP_MAGNITUDE = 8.0
OUTLIER_TOKENS = 2
# magnitudes so small that float16 values go subnormal (below its smallest normal 2^-14), where a flush-to-zero
# kernel shows: an op's deltas from x times 2^-20; a gated expert's activations, products of two pre-activations
# near 2^-10
SUBNORMAL_OP_MAGNITUDE = 2.0 ** -20
SUBNORMAL_EXPERT_MAGNITUDE = 2.0 ** -10
# float16 expert cases: magnitude x (outlier_scale if outliers) at most this; a gated or relu2 activation
# multiplies two pre-activations (~5 sigma = 5 x this), which beyond it leaves float16's 65504 range
FP16_MAX_PEAK = 30.0
# the largest power-of-two magnitude that holds a massive-activation token in float16 (magnitude x 2^10 <= 30): 2^-6
FP16_MASSIVE_MAGNITUDE = 2.0 ** math.floor(math.log2(FP16_MAX_PEAK / MASSIVE_OUTLIER_SCALE))


@dataclass(frozen=True)
class Case:
    """One MoE+LoRA case. Op-level fields describe a `fused_moe_lora` call; expert-level ones a layer forward."""

    level: str = "op"
    T: int = 4              # tokens reaching the experts
    H: int = 64             # hidden size
    I: int = 32             # intermediate size per partition
    E: int = 4              # experts (global; local = E // ep_size)
    top_k: int = 2
    dtype: str = "float16"
    max_loras: int = 2
    max_rank: int = 8
    ranks: tuple = ()       # per-slot adapter rank (0 = empty slot); () = every slot at max_rank
    mapping: str = "uniform"   # token -> LoRA slot pattern
    routing: str = "uniform"   # expert choice: uniform or skewed onto a few hot experts
    shared_a: bool = False     # LoRA A shared across experts (expert-dim 1, stride-0 view)
    shared_b: bool = False
    seed: int = 0
    # op level
    which: str = "w13"         # w13: x (T,H), N = I; w2: x (T*k, I), N = H
    num_slices: int = 2
    mul_routed_weight: bool = False
    add_inputs: bool = True
    offset: int = 0
    layout: str = "sorted"     # sorted (align) or naive (one pair per program)
    block_size_m: int = 16
    fully_sharded: bool = False
    active_loras: str = "all"  # num_active_loras: "all" (L+1) or "unique" (distinct slots; ACTIVE_LORAS)
    # expert level
    activation: str = "silu"
    bias: bool = False
    lora: bool = True
    apply_router_weight_on_input: bool = False
    quant: str = "none"        # expert level: none | int4_g128 | int8_channel (weight-only) | FP8_QUANTS
    # parallelism (expert level: simulated ranks; op level: EP gives an expert_map)
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    # expert level, dispatched expert parallelism: every EP rank runs (its own tokens, dispatched and
    # combined by the backend through a communicator); ep_tokens = tokens per rank (sum = T), ep_size ranks;
    # ep_comm: ranks as turn-taking threads ("simulated") or real processes ("processes": gloo / NCCL)
    ep_tokens: tuple = ()
    ep_comm: str = "simulated"
    # input scale (both levels; defaults leave every tensor bit-identical): hidden states (op level: x) times
    # `magnitude`, so pre-activations reach the activations' clamps (swigluoai's limit 7); `outliers` tokens,
    # chosen from the seed, times a further `outlier_scale` (OUTLIER_SCALE, 30x; MASSIVE_OUTLIER_SCALE, 2^10)
    magnitude: float = 1.0
    outliers: int = 0
    outlier_scale: float = OUTLIER_SCALE
    # a view of this case's inputs (VIEWS; harness.build.properties), judged against the plain case's output: expert
    # level; the op level has 'reordered' (its K permuted through x and every LoRA A)
    view: str = ""
    # expert level: PEFT adapter folders (harness.served.peft_adapters) loaded into slots 0.. instead of random adapters
    # (`ranks` gives each slot's rank, the file's; slots past them stay empty), their decoder layer `adapter_layer`
    adapters: tuple = ()
    adapter_layer: int = 0
    # expert level: the T tokens handed to the backend in consecutive calls of `call_tokens` each (decode steps of
    # one layer, the same weights; 0 = one call). The judge sees all T rows at once: rule 4 pools the calls' rows,
    # so a decode-sized call is judged with a served batch's power (docs/error-model.md, "Decode calls")
    call_tokens: int = 0

    # -- derived -------------------------------------------------------------------------
    @property
    def K(self) -> int:
        """Input dim of the LoRA-A GEMM (op level)."""
        return self.H if self.which == "w13" else self.I

    @property
    def N(self) -> int:
        """Per-slice output dim of LoRA-B (op level)."""
        return self.I if self.which == "w13" else self.H

    @property
    def width(self) -> int:
        """Last dim of the op's output buffer."""
        return self.offset + self.num_slices * self.N

    @property
    def N1(self) -> int:
        """Rows of an expert's w13 (expert level): 2I for a gated activation (gate and up), I otherwise."""
        from moe_lora_harness.reference.activations import is_gated
        return 2 * self.I if is_gated(self.activation) else self.I

    @property
    def local_experts(self) -> int:
        return self.E // self.ep_size

    @property
    def dispatched(self) -> bool:
        """Every EP rank runs, with its own tokens (ep_tokens): the backend dispatches and combines."""
        return bool(self.ep_tokens)

    def rank_of_token(self, t: int) -> int:
        """The EP rank whose batch holds token t (0 for a case that is not dispatched)."""
        end = 0
        for r, n in enumerate(self.ep_tokens):
            end += n
            if t < end:
                return r
        return 0

    @property
    def slot_ranks(self) -> tuple:
        """Rank of each of the max_loras slots (0 = no adapter loaded there)."""
        if self.ranks:
            return tuple(self.ranks) + (0,) * (self.max_loras - len(self.ranks))
        return (self.max_rank,) * self.max_loras

    # -- validation ------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Reasons this case is not a well-formed input (empty list = well formed)."""
        p = []
        def need(cond, msg):
            if not cond:
                p.append(msg)
        need(self.level in LEVELS, f"level must be one of {LEVELS}, got {self.level!r}")
        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        need(self.mapping in MAPPINGS, f"mapping must be one of {MAPPINGS}, got {self.mapping!r}")
        need(self.routing in ROUTINGS, f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        need(self.layout in LAYOUTS, f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        need(self.quant in ALL_QUANTS, f"quant must be one of {ALL_QUANTS}, got {self.quant!r}")
        if self.quant in ("int4_g128", "fp8_block"):
            need(self.H % 128 == 0 and self.I % 128 == 0, f"{self.quant} needs H and I divisible by 128")
        if self.quant in FP8_QUANTS:
            # vLLM quantizes 16-bit activations to FP8; an fp32 model is not served with FP8 experts
            need(self.level == "expert", f"{self.quant} is an expert-level setting")
            need(self.dtype in ("float16", "bfloat16"), f"{self.quant} needs dtype float16 or bfloat16 (the "
                                                        f"activations quantized to FP8), got {self.dtype!r}")
            need(not self.dispatched, f"{self.quant} with dispatched EP (ep_tokens) is not modelled yet")
        need(self.which in WHICH, f"which must be one of {WHICH}, got {self.which!r}")
        need(self.active_loras in ACTIVE_LORAS, f"active_loras must be one of {ACTIVE_LORAS}, got {self.active_loras!r}")
        if self.active_loras != "all":
            need(self.level == "op" and self.layout == "sorted",
                 "active_loras='unique' is an op-level, sorted-layout setting (the naive path does not read "
                 "num_active_loras)")
        need(self.T >= 0, f"T must be >= 0, got {self.T}")
        for n in ("H", "I", "E", "top_k", "max_loras", "max_rank", "num_slices", "block_size_m",
                  "tp_size", "ep_size"):
            need(getattr(self, n) >= 1, f"{n} must be >= 1, got {getattr(self, n)}")
        need(self.top_k <= self.E,
             f"top_k ({self.top_k}) must be <= E ({self.E})")
        need(len(self.ranks) <= self.max_loras, f"ranks has {len(self.ranks)} entries > max_loras {self.max_loras}")
        need(all(0 <= r <= self.max_rank for r in self.ranks),
             f"ranks {self.ranks} must lie in [0, max_rank={self.max_rank}]")
        need(self.offset >= 0, f"offset must be >= 0, got {self.offset}")
        need(self.block_size_m >= 16 and (self.block_size_m & (self.block_size_m - 1)) == 0,
             f"block_size_m must be a power of two >= 16, got {self.block_size_m}")
        if self.dispatched:   # E % ep and fully_sharded are configurations a backend must reject (contract.must_reject)
            need(self.level == "expert", "ep_tokens (dispatched EP) is an expert-level field")
            need(len(self.ep_tokens) == self.ep_size and self.ep_size >= 2,
                 f"ep_tokens must hold one token count per EP rank (ep_size={self.ep_size} >= 2); got {list(self.ep_tokens)}")
            need(all(isinstance(n, int) and n >= 0 for n in self.ep_tokens) and sum(self.ep_tokens) == self.T,
                 f"ep_tokens {list(self.ep_tokens)} must be counts >= 0 summing to T={self.T}")
            need(self.ep_rank == 0, "ep_rank is not used with ep_tokens (every rank runs): leave it 0")
            need(self.tp_size == 1, "dispatched EP with tp_size > 1 is not modelled (vLLM's MoE TP is 1 under EP)")
            need(self.E >= self.ep_size, f"E ({self.E}) must be >= ep_size ({self.ep_size})")
        else:
            need(self.E % self.ep_size == 0, f"E ({self.E}) must be divisible by ep_size ({self.ep_size})")
            need(self.ep_comm == "simulated", "ep_comm is used only with ep_tokens")
        need(self.ep_comm in EP_COMMS, f"ep_comm must be one of {EP_COMMS}, got {self.ep_comm!r}")
        need(0 <= self.ep_rank < self.ep_size, f"ep_rank must lie in [0, {self.ep_size})")
        need(0 <= self.tp_rank < self.tp_size, f"tp_rank must lie in [0, {self.tp_size})")
        need(not (self.ep_size > 1 and self.fully_sharded) or self.dispatched,
             "EP with fully_sharded LoRA is not supported (vLLM rejects it)")
        if self.level == "expert" and self.tp_size > 1:   # every TP rank is simulated; tp_rank is not used
            need(self.ep_size == 1, "expert level: tp_size > 1 with ep_size > 1 is not modelled (vLLM's MoE TP is 1 "
                                    "under EP)")
            need(self.I % self.tp_size == 0, f"expert level: I ({self.I}) must be divisible by tp_size ({self.tp_size})")
            need(self.quant == "none", "expert level: tensor parallel with quantized weights is not modelled")
            if self.fully_sharded and self.lora:
                need(self.max_rank % self.tp_size == 0 and self.H % self.tp_size == 0,
                     f"fully_sharded: max_rank ({self.max_rank}) and H ({self.H}) must be divisible by tp_size "
                     f"({self.tp_size})")
        need(not (self.ep_size > 1 and self.layout == "naive"), "naive block assignment is disabled under EP")
        need(self.add_inputs or not self.fully_sharded,
             "fully_sharded needs add_inputs=True (vLLM asserts add_inputs or not fully_sharded)")
        if self.apply_router_weight_on_input:
            need(self.top_k == 1, "apply_router_weight_on_input needs top_k == 1")
        if self.adapters:
            need(self.level == "expert" and self.tp_size == 1 and not self.dispatched,
                 "adapters (files) are an expert-level setting of one TP rank: the files hold the whole layer")
            need(all(isinstance(a, str) and a for a in self.adapters), "adapters must be folder paths (strings)")
            need(len(self.ranks) >= len(self.adapters) and all(r > 0 for r in self.ranks[:len(self.adapters)]),
                 f"adapters: ranks must give each adapter file's rank (> 0); got ranks {list(self.ranks)} for "
                 f"{len(self.adapters)} file(s)")
            need(not (self.shared_a or self.shared_b), "adapters (files) hold per-expert factors: no shared A or B")
        need(isinstance(self.adapter_layer, int) and self.adapter_layer >= 0,
             f"adapter_layer must be an int >= 0, got {self.adapter_layer!r}")
        need(self.view in VIEWS, f"view must be one of {VIEWS}, got {self.view!r}")
        if self.view:
            need(self.view == "reordered" or (self.level == "expert" and not self.dispatched and self.tp_size == 1),
                 f"view={self.view!r} is an expert-level setting of one rank (no dispatched EP, tp_size 1); the op "
                 f"level, TP and dispatched EP have the 'reordered' view alone")
            need(self.T >= 2 or self.view == "reordered",
                 f"view={self.view!r} needs T >= 2 tokens (a view of one token's rows is the token)")
            if self.view == "slots_rotated":
                need(self.lora and self.max_loras >= 2, "view='slots_rotated' needs LoRA and max_loras >= 2")
            if self.view == "reordered":
                need(self.level != "expert" or self.H % self.tp_size == 0,
                     f"view='reordered' permutes H within each TP rank's shard: H ({self.H}) must be divisible by "
                     f"tp_size ({self.tp_size})")
                need(self.quant in REORDERED_QUANTS, "view='reordered' permutes the weights' K and N: "
                     f"{self.quant}'s packed weights would not follow (quant 'none' or an FP8 scheme, whose scale "
                     f"blocks move whole)")
        ct = self.call_tokens
        need(isinstance(ct, int) and not isinstance(ct, bool) and ct >= 0,
             f"call_tokens (tokens per backend call) must be an int >= 0, got {ct!r}")
        if isinstance(ct, int) and ct > 0:
            need(self.level == "expert" and not self.dispatched and self.tp_size == 1
                 and self.view in ("", "reordered"),
                 "call_tokens is an expert-level setting of one rank (no dispatched EP, tp_size 1, no token view)")
            need(self.T >= ct and self.T % ct == 0,
                 f"call_tokens={ct} must divide T={self.T} (every call the same size, so one rounding model "
                 f"holds for all of them)")
        m = self.magnitude
        m_ok = isinstance(m, (int, float)) and not isinstance(m, bool) and math.isfinite(m) and 0 < m <= MAX_MAGNITUDE
        need(m_ok, f"magnitude (the hidden states' scale) must be a number in (0, {MAX_MAGNITUDE:g}], got {m!r}")
        o, s = self.outliers, self.outlier_scale
        s_ok = (isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s)
                and 1 <= s <= MASSIVE_OUTLIER_SCALE)
        need(s_ok, f"outlier_scale (the outlier tokens' further scale) must be a number in [1, "
                   f"{MASSIVE_OUTLIER_SCALE:g}], got {s!r}")
        o_ok = isinstance(o, int) and not isinstance(o, bool) and 0 <= o <= max(self.T, 0)
        need(o_ok, f"outliers (tokens scaled {s if s_ok else OUTLIER_SCALE:g}x) must be an int in [0, T={self.T}], "
                   f"got {o!r}")
        if m_ok and o_ok and s_ok and self.level == "expert" and self.dtype == "float16":
            peak = m * (s if o else 1.0)
            need(peak <= FP16_MAX_PEAK,
                 f"float16: magnitude x outlier scale = {peak:g} exceeds {FP16_MAX_PEAK:g}; the activation's product "
                 f"of two pre-activations would leave float16's range (65504): use float32 / bfloat16, fewer "
                 f"outliers or a smaller magnitude")
        return p

    # -- identity and serialisation -----------------------------------------------------------
    def to_json(self) -> str:
        """Compact JSON holding only the fields that differ from the defaults (stable key order)."""
        d = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v != f.default:
                d[f.name] = list(v) if isinstance(v, tuple) else v
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Case":
        """Inverse of `to_json`; unknown keys are an error naming them."""
        d = json.loads(text) if isinstance(text, str) else dict(text)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown Case field(s) {unknown}; known fields: {sorted(names)}")
        for name in ("ranks", "ep_tokens", "adapters"):
            if name in d:
                d[name] = tuple(d[name])
        return cls(**d)

    def replace(self, **kw) -> "Case":
        return dataclasses.replace(self, **kw)

    @property
    def calls(self) -> int:
        """How many backend calls the case's tokens are handed over in (1 unless call_tokens splits them)."""
        return self.T // self.call_tokens if self.call_tokens else 1

    def per_call(self) -> "Case":
        """The case as one backend call sees it (T = call_tokens): what declarations and rounding models are asked
        about, since the backend picks its path from the call it is given."""
        return dataclasses.replace(self, T=self.call_tokens, call_tokens=0) if self.call_tokens else self

    @property
    def id(self) -> str:
        """Short stable identifier for test ids (readable fields, then a digest of the full JSON)."""
        import hashlib
        h = hashlib.sha1(self.to_json().encode()).hexdigest()[:8]
        head = f"{self.level}-{self.which if self.level == 'op' else self.activation}-{self.dtype}-T{self.T}"
        if self.dispatched:
            head += f"-ep{self.ep_size}{'p' if self.ep_comm == 'processes' else ''}"
        if self.call_tokens:
            head += f"-calls{self.calls}x{self.call_tokens}"
        return f"{head}-{h}"
