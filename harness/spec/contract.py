"""The backend contract: what a backend declares (data) and how a case is checked against it.

Modelled on PyTorch's OpInfo: one declarative record per backend, every unsupported feature carrying
its reason, so a skip is a declared capability and never a silent one. Claims are checked both ways:
a backend that claims a case and fails it fails; one that works where it claims not to is reported.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from moe_lora_harness.harness.spec.case import Case


# Messages of a backend's own environment checks (a framework's distributed state missing): such a raise is
# an environment failure of the run, not a defect of the kernel (every backend; a spec adds its own).
ENVIRONMENT_ERRORS = (r"parallel group is not initiali[sz]ed", r"default process group has not been initiali[sz]ed",
                      r"init_process_group", r"model parallel .* not initiali[sz]ed")


@dataclass(frozen=True)
class Rule:
    """An extra declared constraint: `holds(case)` must be true for the backend to claim the case, on every
    device or only on those in `devices` (e.g. a run that adds nothing under the CPU's Triton interpreter)."""

    name: str
    holds: Callable[[Case], bool]
    reason: str
    devices: frozenset | None = None          # device kinds (cpu, cuda) the rule applies on; None: every one


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports, as data. `None` means "anything"."""

    levels: frozenset = frozenset({"op"})
    devices: frozenset = frozenset({"cpu", "cuda"})
    device_reasons: Mapping = field(default_factory=dict)   # device -> why it is not in `devices`
    # device -> dtypes supported there; `dtype_reasons[(device, dtype)]` says why one is missing
    dtypes: Mapping = field(default_factory=lambda: {
        "cpu": frozenset({"float16", "bfloat16", "float32"}),
        "cuda": frozenset({"float16", "bfloat16", "float32"})})
    dtype_reasons: Mapping = field(default_factory=dict)
    layouts: frozenset = frozenset({"sorted", "naive"})
    # why a value of a set-valued declaration (layouts, activations, quant) is missing: {("layout", "sorted"):
    # "..."}; the reason a case is declined with, as dtype_reasons is for a dtype
    reasons: Mapping = field(default_factory=dict)
    max_rank: int | None = None
    fully_sharded: bool = True
    expert_map: bool = True
    shared_lora: bool = True
    activations: frozenset | None = None      # expert level; None = every reference activation
    non_gated: bool = True
    bias: bool = True
    lora: bool = True                         # expert level: can run with LoRA
    base_only: bool = True                    # expert level: can run without LoRA
    tensor_parallel: bool = False             # expert level: simulated TP ranks
    expert_parallel: bool = False             # expert level: dispatched EP (its own dispatch/combine over ep_comm)
    quant: frozenset = frozenset({"none"})     # expert level: weight-only schemes accepted
    rules: tuple = ()
    # layer level (harness.spec.layer_contract): captures graphs and replays them; the largest batch it takes
    # (None: any LayerConfig.max_tokens); loads an adapter into a slot that held another
    graphs: bool = False
    max_tokens: int | None = None
    slot_reuse: bool = True
    # layer level: a token may be mapped to a slot that holds no adapter (False: the engine cannot say so; vLLM maps
    # adapter ids, and an unloaded id raises): scenarios then map tokens only to loaded slots or -1
    maps_unloaded_slots: bool = True
    # layer level: the values LayerConfig.max_rank may take (vLLM: 1, 8, 16, 32, 64, ...; None: any); a
    # configuration is built at the smallest allowed max_rank that holds its adapters
    layer_max_ranks: frozenset | None = None
    # layer level: LoRA dtypes it holds factors in besides its activation dtype (LayerConfig.lora_dtype)
    layer_lora_dtypes: frozenset = frozenset()
    # expert level: a token's output is the same bits whatever else is in its batch, its place in it and its
    # adapter's slot number (vLLM's batch-invariant mode); the property views (harness.build.properties) hold it exactly
    batch_invariant: bool = False


@dataclass(frozen=True)
class KnownBug:
    """A ledger entry: a known wrong answer, citing its issue. A matching case that passes fails the run.
    `applies(case)` matches from the case alone; `shows(case, before, written)`, where given, also from what the
    judge drew for it (the output buffer as handed over, None at the expert level; the elements the contract
    writes), for a bug that only some draws of a case meet."""

    issue: str
    description: str
    applies: Callable[[Case], bool]
    shows: Callable | None = None


@dataclass(frozen=True)
class ExpertCall:
    """Arguments of an expert-level run; the backend writes its (T, H) result into `output` in place."""

    output: object
    hidden_states: object
    w13: object
    w2: object
    topk_weights: object
    topk_ids: object
    activation: str
    w13_bias: object = None
    w2_bias: object = None
    w13_lora_a: list | None = None
    w13_lora_b: list | None = None
    w2_lora_a: list | None = None
    w2_lora_b: list | None = None
    adapter_enabled: object = None
    token_lora_mapping: object = None
    max_loras: int = 0
    expert_map: object = None
    apply_router_weight_on_input: bool = False
    # weight-only quantized base weights (Marlin-style): int8 values in the scheme's range and scales;
    # `w13`/`w2` then hold the dequantized weights (what the reference uses)
    quant: str = "none"
    w13_q: object = None
    w13_scales: object = None
    w2_q: object = None
    w2_scales: object = None
    # tensor parallelism: this call is TP rank `tp_rank` of `tp_size`, its weights already sliced; with
    # `fully_sharded` the LoRA joins its shrink outputs through `lora_collective(cache, which)` (which:
    # "w13" all-gather on the rank dim, "w2" all-reduce), None = torch.distributed's default group
    tp_rank: int = 0
    tp_size: int = 1
    fully_sharded: bool = False
    lora_collective: object = None
    # dispatched expert parallelism (a case with ep_tokens): this call is EP rank `ep_rank` of `ep_size`.
    # hidden_states, topk_weights, topk_ids (GLOBAL expert ids), token_lora_mapping and output hold this
    # rank's own tokens; w13/w2 (biases, quantized tensors) its local experts [r*E/ep, (r+1)*E/ep); the
    # LoRA factors all `num_experts_global` experts, as an adapter is loaded (the backend slices its own).
    # The backend dispatches and combines through `ep_comm` (harness.execution.communicator.Communicator); expert_map
    # is None (the backend derives its own). With fully_sharded, or E % ep != 0, it must raise (must_reject).
    ep_comm: object = None
    ep_rank: int = 0
    ep_size: int = 1
    num_experts_global: int = 0


@dataclass(frozen=True)
class BackendSpec:
    """One backend: name, capabilities, entry points, and the rounding model its path follows.

    `op`: a callable with vLLM 0.33.0's `fused_moe_lora` signature (op_contract.validate.validate_call's),
    in place; the harness passes it keywords.
    `experts`: a callable taking an `ExpertCall` and writing `call.output`.
    `layer`: a factory `(LayerConfig, LayerWeights) -> layer` of a stateful layer (harness.spec.layer_contract).
    `precision`: a reference precision preset name, or `case -> name` when the path depends on the case, or a
    mapping from device kind ("cpu", "cuda") to either, when it depends on the device (fp32 `tl.dot` is TF32 on
    a GPU by default, IEEE fp32 in the CPU interpreter).
    `model_points_only`: True (or a mapping from device kind to it) when the backend rounds exactly where its
    precision model rounds and nowhere else (no extra or double rounding, no reduced-precision reduction); rule 4
    then allows its fp32 accumulation alone, a sharper judge (docs/error-model.md); with FP8 activations it also
    claims the model's scale arithmetic (`amax / 448`, then `x / s`, each an fp32 division), and no rule allows it
    the flips another arithmetic takes at e4m3 ties. A false claim fails correct outputs that round elsewhere:
    declare it only where that is known.
    `fp8_mma`: a mapping from device kind to how the backend's FP8 base GEMMs accumulate there (or to `case -> that`,
    asked about one call of the case): the products per tile of the sm_90 warpgroup MMA promoted into an fp32
    accumulator (an int, a multiple of 32, K in order, no split-K), "chained" (that MMA's one accumulator through
    K), or "fp32" (exact e4m3 products summed in fp32, as mma.sync does). On an sm_90 GPU the judge then emulates
    those GEMMs with that arithmetic (reference.fp8_mma) and judges their accumulation statistically; undeclared, a
    worst-case term allows it. A false declaration fails correct outputs.
    """

    name: str
    description: str
    capabilities: Capabilities
    op: Callable | None = None
    experts: Callable | None = None
    layer: Callable | None = None
    precision: str | Callable[[Case], str] | Mapping = "one_shot"
    model_points_only: bool | Mapping = False
    fp8_mma: Mapping | None = None
    known_bugs: tuple = ()
    origin: str = ""
    # the backend's environment: `setup` (a callable, or a "module:attr" reference to one) runs once per
    # process that calls the backend, before its first call (e.g. a single-rank process group, a framework's
    # parallel-state init); a raise whose message matches one of `environment_errors` (regexes; the common
    # ones in ENVIRONMENT_ERRORS always apply) is an environment failure, not a kernel bug
    setup: Callable | str | None = None
    environment_errors: tuple = ()
    # a variant of another backend (the same kernels in another schedule or with forced knobs, each with tests of
    # its own): why its conformance tests (named rows, random cases, layer scenarios) run in the CPU suites' full
    # tier only (harness.front.pytest_plugin's tiers; on CUDA every tier runs them; empty: in both tiers)
    cpu_rows_in_full_tier: str = ""

    def precision_for(self, case: Case, device: str) -> str:
        """The rounding model of the path this backend takes for `case` on `device` (for each of its calls: a
        case of several calls is asked about as one call sees it, Case.per_call)."""
        case = case.per_call()
        p = self.precision
        if isinstance(p, Mapping):
            kind = device_kind(device)
            if kind not in p:
                raise ValueError(f"precision declares no rounding model for device {kind} (it declares "
                                 f"{sorted(p)})")
            p = p[kind]
        return p(case) if callable(p) else p


    def model_points_only_for(self, device: str) -> bool:
        """Whether this backend declares that it rounds only where its model rounds, on `device`."""
        p = self.model_points_only
        return bool(p.get(device_kind(device), False) if isinstance(p, Mapping) else p)


    def fp8_mma_for(self, case: Case, device: str) -> int | str | None:
        """How this backend declares its FP8 GEMMs accumulate for `case` on `device` (`fp8_mma`), None where it
        declares nothing."""
        from moe_lora_harness.reference.fp8_mma import is_tile
        got = (self.fp8_mma or {}).get(device_kind(device))
        if callable(got):
            got = got(case.per_call())
        if got is not None and got not in ("chained", "fp32") and not is_tile(got):
            raise ValueError(f"fp8_mma must map a device kind to a positive multiple of 32 (products per promoted "
                             f"tile), 'chained' or 'fp32' (or a function of the case giving one); got {got!r} for "
                             f"{device_kind(device)}")
        return got


def device_kind(device: str) -> str:
    """'cpu' or 'cuda' (any cuda:N): what declarations are keyed by."""
    return "cuda" if str(device).startswith("cuda") else str(device)


@dataclass(frozen=True)
class Rejection:
    """A configuration the contract says a backend must refuse: it must raise an error whose message
    matches `names` (so it names the setting), never run. `nearest` is the closest valid case: what a
    backend's declarations are asked about (a backend that cannot run it at all is not asked to refuse)."""

    what: str
    names: str          # regex (case-insensitive) the error message must match
    nearest: Case


def must_reject(case: Case) -> Rejection | None:
    """The contract's rejected configurations (vLLM's EP+LoRA layer refuses both at construction)."""
    if not case.dispatched:
        return None
    if case.fully_sharded and case.lora:
        return Rejection("expert parallelism with fully-sharded LoRA (both shard over the same group)",
                         r"fully[ _-]?shard", case.replace(fully_sharded=False))
    if case.E % case.ep_size:
        return Rejection(f"E={case.E} experts over ep_size={case.ep_size} ranks (LoRA slices [r*E/ep, (r+1)*E/ep) "
                         f"need an even split)", r"divisible|E ?% ?ep|even split",
                         case.replace(E=case.ep_size * max(1, case.E // case.ep_size)))
    return None


def support_for(spec: BackendSpec, case: Case, device: str, *, layer: bool = False) -> tuple[bool, str]:
    """(ok, reason): whether `spec` claims `case` on `device`, judged only from its declarations.

    A configuration the contract rejects is claimed when the nearest valid one is (it must be refused). A case of
    several calls is claimed when one call is (Case.per_call: the backend sees one call at a time).
    `layer`: `case` is the expert-level description of a layer's batch (harness.layer.layer_runner.layer_support)."""
    case = case.per_call()
    rejection = must_reject(case)
    if rejection is not None:
        case = rejection.nearest
    cap = spec.capabilities
    dev = device_kind(device)
    level = "layer" if layer else case.level
    if level not in cap.levels:
        return False, f"{level}-level runs are not provided (levels: {sorted(cap.levels)})"
    if level == "op" and spec.op is None:
        return False, "declares no op entry point"
    if level == "expert" and spec.experts is None:
        return False, "declares no expert entry point"
    if level == "layer" and spec.layer is None:
        return False, "declares no layer factory"
    if dev not in cap.devices:
        why = cap.device_reasons.get(dev)
        return False, f"on {dev}: {why}" if why else f"device {dev} not supported (devices: {sorted(cap.devices)})"
    if case.dtype not in cap.dtypes.get(dev, frozenset()):
        why = cap.dtype_reasons.get((dev, case.dtype), "not declared")
        return False, f"{case.dtype} on {dev}: {why}"
    if case.level == "op":
        if case.layout not in cap.layouts:
            return False, _missing(cap, "layout", case.layout,
                                   f"{case.layout} block assignment not supported (layouts: {sorted(cap.layouts)})")
        if case.fully_sharded and not cap.fully_sharded:
            return False, "fully_sharded not supported"
    if cap.max_rank is not None and case.max_rank > cap.max_rank:
        return False, f"max_rank {case.max_rank} > supported {cap.max_rank}"
    if case.dispatched and not cap.expert_parallel:
        return False, "dispatched expert parallelism not declared (Capabilities.expert_parallel)"
    if case.ep_size > 1 and not cap.expert_map:
        return False, "expert_map (expert parallel) not supported"
    if (case.shared_a or case.shared_b) and not cap.shared_lora:
        return False, "shared (expert-dim 1) LoRA not supported"
    if case.level == "expert":
        from moe_lora_harness.reference.activations import is_gated
        if cap.activations is not None and case.activation not in cap.activations:
            return False, _missing(cap, "activation", case.activation, f"activation {case.activation} not supported "
                                                                        f"(supported: {sorted(cap.activations)})")
        if not is_gated(case.activation) and not cap.non_gated:
            return False, f"non-gated activation {case.activation} not supported (gated only)"
        if case.bias and not cap.bias:
            return False, "biases not supported"
        if case.lora and not cap.lora:
            return False, "LoRA not supported"
        if not case.lora and not cap.base_only:
            return False, "runs only with LoRA"
        if case.quant not in cap.quant:
            return False, _missing(cap, "quant", case.quant,
                                   f"quant scheme {case.quant} not supported (supported: {sorted(cap.quant)})")
        if case.tp_size > 1 and not cap.tensor_parallel:
            return False, "tensor-parallel ranks not supported"
        if case.fully_sharded and case.lora and not cap.fully_sharded:
            return False, "fully_sharded LoRA not supported"
    for rule in cap.rules:
        if (rule.devices is None or dev in rule.devices) and not rule.holds(case):
            return False, f"{rule.name}: {rule.reason}"
    return True, ""


def _missing(cap: Capabilities, axis: str, value: str, what: str) -> str:
    """What a declined value says: the declared reason after what is missing, when there is one."""
    why = cap.reasons.get((axis, value))
    return f"{what}: {why}" if why else what


def known_bug_for(spec: BackendSpec, case: Case, before=None, written=None) -> KnownBug | None:
    """The ledger entry expected to make this case fail, if any (`before`, `written`: the judge's draw, for the
    entries that look at it)."""
    for bug in spec.known_bugs:
        if bug.applies(case.per_call()) and (bug.shows is None or bug.shows(case, before, written)):
            return bug
    return None
