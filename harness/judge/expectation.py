"""What an output is judged against: an op-level case's float64 truth and the emulation of a declared rounding
model (the expert level's: harness.build.expert_runner), and the elements compared at either level. The runner
judges with them; the precision diagnosis (harness.judge.diagnose) re-judges a failure against other models. Everything
is computed where the inputs lie: on a CUDA run's device (the judge's own process), else on the CPU."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from moe_lora_harness.harness.judge.compare import EXCESS_MIN_ROWS, ByInverseWeight
from moe_lora_harness.harness.build.builders import build_device, build_op_inputs, torch_dtype
from moe_lora_harness.harness.spec.case import FP8_QUANTS, Case
from moe_lora_harness.op_contract.validate import validate_call
from moe_lora_harness.reference.lora_op import fused_moe_lora_expected
from moe_lora_harness.reference.precision import bound_dtype, precision as make_precision


def op_reference(case: Case, inputs, precision_name: str | None = None):
    """The float64 truth with its magnitudes (precision_name None), or the emulation of `precision_name`
    (its value only: every emulation is judged with the truth's magnitudes), on the inputs' device."""
    prec = (make_precision("exact", None) if precision_name is None
            else make_precision(precision_name, torch_dtype(case)))
    return fused_moe_lora_expected(validate_call(**inputs.call_kwargs()), precision=prec,
                                   magnitudes=precision_name is None)


def op_expectations(case: Case, backend_precision: str, device="cpu"):
    """(inputs, truth, emulation) for an op-level case, built and computed on `build_device(device)`."""
    inputs = build_op_inputs(case, build_device(device))
    return inputs, op_reference(case, inputs), op_reference(case, inputs, backend_precision)


def declared_rounding(spec, case: Case, device: str) -> tuple[str, bool, int | str | None]:
    """What the judge reads of a backend's own declarations (its BackendSpec) for `case` on `device`: its rounding
    model's name (checked to name one), whether it rounds only at that model's points, and the FP8 accumulation the
    judge emulates for it (`modelled_mma`). The backend's code runs here, so an error here is the backend's; the
    harness's own reference runs after it, where an error is ours."""
    precision = spec.precision_for(case, device)
    make_precision(precision, torch_dtype(case))       # an unknown model's name is the declaration's mistake
    return precision, bool(spec.model_points_only_for(device)), modelled_mma(spec, case, device)


# the most e4m3 products (both base GEMMs) for which the judge emulates a declared truncating MMA (`modelled_mma`);
# past it the worst-case term stands: the emulation runs each product through the MMA's arithmetic elementwise in
# float64, 1.4-1.8e10 products a second on an H100 (bench/results/2026-12-06-gpu-s41): this many in about 19 s
MMA_PRODUCTS_MAX = 1 << 38


def mma_products(case: Case) -> int:
    """The e4m3 products of an expert-level case's two base GEMMs (every pair through w13 and w2)."""
    return case.T * case.top_k * (case.N1 * case.H + case.H * case.I)


def modelled_mma(spec, case: Case, device: str) -> int | str | None:
    """The backend's declared FP8 accumulation (BackendSpec.fp8_mma) where the judge emulates it for `case` on
    `device`: an expert-level FP8 case of one rank, neither dispatched nor a view (whose K order is another), on an
    sm_90 GPU (the arithmetic reference.fp8_mma reproduces), of at most MMA_PRODUCTS_MAX products for a truncating
    MMA. None elsewhere: the FP8 floor keeps its worst-case accumulation term there (`fp8_accumulation_modelled`)."""
    from moe_lora_harness.harness.spec.case import FP8_QUANTS
    from moe_lora_harness.harness.spec.contract import device_kind
    if (device_kind(device) != "cuda" or case.level != "expert" or case.quant not in FP8_QUANTS or case.view
            or case.dispatched or case.tp_size != 1):
        return None
    declared = spec.fp8_mma_for(case, device)
    if declared is None or (declared != "fp32" and mma_products(case) > MMA_PRODUCTS_MAX):
        return None
    return declared if torch.cuda.get_device_capability(torch.device(device)) == (9, 0) else None


def fp8_accumulation_modelled(device, mma=None) -> bool:
    """Whether the statistical model's fp32 accumulation holds for FP8 products on `device` (the backend's): on a CPU
    (no e4m3 MMA there: the exact products are summed in fp32), and on a GPU where the kernel declares its
    accumulation (`mma`, from `modelled_mma`: "fp32" sums as a CPU's, or a truncating MMA that the emulation runs bit
    for bit). Elsewhere on a GPU the FP8 floor keeps its worst-case term (measured on the H200 with
    bench/probe_fp8_floor.py: a correct kernel lies up to 2,700 times the fp32 term from an emulation of exact sums)."""
    from moe_lora_harness.harness.spec.contract import device_kind
    return device is not None and (device_kind(device) == "cpu" or mma is not None)


def fp8_sums_exact(device, mma=None) -> bool:
    """Whether a backend's FP8 base GEMMs sum the exact e4m3 products in fp32 where it ran: on a CPU, and on a GPU
    where it declares `mma` "fp32" (reference.fp8_mma). There the statistical model covers its activation's deviation
    from the truth, so rule 4 judges FP8 rows (reference.experts.ExpertExpected.flip_sq) and a twin can run."""
    from moe_lora_harness.harness.spec.contract import device_kind
    return device is not None and (device_kind(device) == "cpu" or mma == "fp32")


def allowances(truth, device=None, mma=None, twin: bool = False, points_only: bool = False) -> dict:
    """compare_written's allowances of a truth beyond its scale and underflow, None where it has none: the FP8 flips
    (reference.experts.ExpertExpected.flip, .one_flip, .slack_flip, .flip_sq; the op level quantizes no activation)
    and the statistical model's accumulation variance and rounding exposure (`acc_var`, `round_var`). With FP8
    activations (`one_flip` set) `acc_var` is kept only where `fp8_accumulation_modelled(device, mma)` (`device`:
    where the backend ran; None: unknown, the worst-case term), and `round_var` and `flip_sq` (rule 4 over FP8 rows)
    only where the e4m3 products are summed exactly (`fp8_sums_exact`: the flips' chances are bounded from the fp32
    accumulation's variance, which a truncating MMA exceeds) and the truth carries the flips' expected square; under a
    modelled truncating MMA only with a `twin` run of a backend that rounds at its model's points (`points_only`),
    whose measure alone then bounds the flips (flip_sq infinite: the twin's cap is the allowance). Such a backend
    computes the activations' scales and operands with the model's own fp32 divisions, so the GEMM1 flips only
    another scale arithmetic takes (`slack_flip`) are allowed it nowhere (rule 3's floors as rule 4)."""
    got = {name: getattr(truth, name, None)
           for name in ("flip", "one_flip", "slack_flip", "acc_var", "round_var", "flip_sq")}
    if got["one_flip"] is not None:
        if points_only:
            got["slack_flip"] = None
        if not fp8_accumulation_modelled(device, mma):
            got["acc_var"] = None
        measured = twin and points_only and mma is not None and not fp8_sums_exact(device, mma)
        if got["acc_var"] is None or got["flip_sq"] is None or not (fp8_sums_exact(device, mma) or measured):
            got["round_var"] = got["flip_sq"] = None
        elif measured:
            got["flip_sq"] = torch.full_like(got["flip_sq"], math.inf)
    return got


@dataclass(frozen=True)
class Rules:
    """How a case's output is judged beyond its truth and emulation, one record for the verdict and every diagnosis
    that re-judges the output (else a diagnosis, judging more leniently, passes what the verdict failed): where the
    backend ran (`device`: the FP8 accumulation term, `allowances`), whether it rounds only at its model's points
    (`points_only`: rule 4's allowance, BackendSpec.model_points_only), rule 4's row labellings (`groups`) and the
    e4m3 MMA the emulation runs (`mma`, `modelled_mma`: every emulation the output is held to runs it)."""

    device: str | None = None
    points_only: bool = False
    groups: object = None
    twin: torch.Tensor | None = None     # the other run of a twin pair, in the plain columns (`twin_applies`)
    mma: int | str | None = None
    sources: int | None = None           # with a twin: the fewest independent error sources a row has (`twin_sources`)

    def kwargs(self, truth) -> dict:
        """compare_written's keyword arguments for `truth` (its allowances) under these rules."""
        return dict(row_groups=self.groups, model_points_only=self.points_only, twin=self.twin,
                    twin_sources=self.sources,
                    **allowances(truth, self.device, self.mma, self.twin is not None, self.points_only))


def twin_applies(case: Case, device=None, mma=None, points_only: bool = False) -> bool:
    """Whether the judge runs the backend twice on `case`, the second time on its reordered view (every long sum in
    another order), and judges each run with the other as its twin (compare.row_excess): where rule 4 can act (83
    rows or more) on an fp32 output, whose accumulation error a bound for every summation order overstates 25 to 60
    times for a blocked kernel (docs/error-model.md, "The twin run"); and on FP8 activations of a backend declared to
    round at its model's points (`points_only`) whose e4m3 products are summed exactly there (`device` a CPU, or its
    declared `mma` "fp32"): its e4m3 flips, which a bound overstates 10-25 times, as the other order flips them; or
    under a declared truncating MMA the judge emulates (`mma` an int), each run then held to its own emulation
    (`twin_own_emulation`) where both emulations fit MMA_PRODUCTS_MAX: expert level, one rank. An fp32 case at the
    expert level (TP: each rank's shard permuted within; dispatched EP) or the op level (its reordered view permutes K
    through x and every LoRA A: each shrink in another order). An fp32 case of fewer rows too, where its rows are
    long enough (TWIN_ROW_ELEMENTS) for rule 3's twin measure to beat the bound for every order."""
    from moe_lora_harness.harness.spec.contract import must_reject
    if not (case.level in ("expert", "op") and not case.view and must_reject(case) is None):
        return False
    rows = case.T >= EXCESS_MIN_ROWS
    if case.quant in FP8_QUANTS:
        return rows and points_only and not case.dispatched and case.tp_size == 1 and (fp8_sums_exact(device, mma)
                                or (twin_own_emulation(case, mma) and 2 * mma_products(case) <= MMA_PRODUCTS_MAX))
    return (case.quant == "none" and torch_dtype(case) == torch.float32 and min(reordered_sums(case)) >= TWIN_MIN_SUM
            and (rows or row_elements(case) >= TWIN_ROW_ELEMENTS) and not case.replace(view="reordered").problems())


# the shortest sum the reordered view must reorder for the twin to measure it. Two orders of a short sum often give
# the same fp32 result (two terms always: addition commutes), so the twins' difference says nothing of that source;
# the model (Gaussian errors, correlation under TWIN_RHO) needs such coincidences rare. Measured (fp32 sums of
# products of normals, two random orders): equal results 80 % at 3 terms, 50 % at 6, 29 % at 16, 15 % at 64, 10 % at
# 128; and random correct kernels (eager, our Triton op) failed with a twin at sums of 4-17 terms (rows of few
# sources alike in both runs), none at 64 or more (forty-seventh session; docs/error-model.md, "Short sums")
TWIN_MIN_SUM = 64


def reordered_sums(case: Case) -> tuple:
    """The lengths of the sums the reordered view reorders: H and a TP rank's shard of I (expert level), K (op)."""
    return (case.H, case.I // case.tp_size) if case.level == "expert" else (case.K,)


# the elements an output row needs for the twin below rule 4's rows: rule 3's twin measure kappa ||out - twin|| is
# about 1.4 kappa times the row's accumulation error, where the bound for every order is about twelve times it in fp32;
# kappa (harness.judge.twin_floor) is under 1 from 512 elements a row (0.90-0.92 for 1-16 rows, 1.1 at 256, 2.1 at
# 64): past it the second run buys a floor near the kernel's own error, short of it a toy case runs twice for little
TWIN_ROW_ELEMENTS = 512


def twin_sources(case: Case) -> int | None:
    """The fewest independent accumulation-error sources an output row of `case` may have, which rule 3's twin
    measure counts as the row's elements at most (None: every element its own). At the op level a row's error is a
    function of its rank intermediates, whose expand the twin does not reorder: each slice's rank values per route
    (one set where a shared A gives every route of a token the same), at the least rank a slot has; a row of two such
    values is two sources, not N elements. At the expert level each of H is a GEMM2 sum of its own, but the error its
    inputs carry is a function of the row's activations, I per route (one route where expert parallelism may leave a
    row one local expert): where those are fewer than H, they are the count."""
    if case.level == "expert":
        acts = case.I * (case.top_k if case.ep_size == 1 else 1)
        return acts if acts < case.H else None
    ranks = [r for r in case.slot_ranks if r > 0] or [case.max_rank]
    return case.num_slices * min(ranks) * (1 if case.shared_a else case.top_k)


def row_elements(case: Case) -> int:
    """The elements of one token's output row the judge compares: H at the expert level; at the op level each of
    its top_k routes' slices of N (the offset's columns are not written)."""
    return case.H if case.level == "expert" else case.top_k * case.num_slices * case.N


def twin_own_truth(case: Case) -> bool:
    """Whether the twin run has its own truth: an op-level case, whose reordered view scales every LoRA B
    (harness.build.properties.OP_TWIN_B_SCALE) so that the expand rounds elsewhere too. The twin is then judged
    against its own truth and emulation alone (`judge_twins`), and the plain run held to it (`held_to`)."""
    return case.level == "op"


def twin_own_emulation(case: Case, mma=None) -> bool:
    """Whether each run of a twin pair is judged against its own emulation: where the twin has its own truth
    (`twin_own_truth`), and FP8 under a truncating e4m3 MMA (`mma` an int: modelled_mma), whose promotion windows
    follow the K order, so that the reordered view's emulation is another than the plain case's by far more than a
    correct kernel's deviation from either (the emulations cost twice: twin_applies keeps both within
    MMA_PRODUCTS_MAX)."""
    return twin_own_truth(case) or (case.quant in FP8_QUANTS and mma not in (None, "fp32"))


def emulate_twin(case: Case, precision: str, view_inputs, device: str, mma=None) -> torch.Tensor | None:
    """The twin's own emulation (`twin_own_emulation`), computed on the reordered view's inputs `view_inputs` on
    `device`, in the plain columns; None where the twin shares the case's. The runner's and selftest --power's."""
    if not twin_own_emulation(case, mma):
        return None
    if twin_own_truth(case):     # the op level: the view's own reference
        return op_reference(case, view_inputs, precision).value
    from moe_lora_harness.harness.build.expert_runner import expert_expectations
    from moe_lora_harness.harness.build.properties import twin_columns
    emu = expert_expectations(case.replace(view="reordered"), precision, emulation_only=True, device=device,
                              inputs=view_inputs, mma=mma)[2]
    return twin_columns(emu.value, case)


def twin_truth(case: Case, view_inputs):
    """The twin's own truth (`twin_own_truth`), computed on the reordered view's inputs where they lie; None where
    the twin shares the case's."""
    return op_reference(case, view_inputs) if twin_own_truth(case) else None


def held_to(other: torch.Tensor | None, other_emulation: torch.Tensor, emulation: torch.Tensor):
    """The twin a run is held to (`Rules.twin`): the other run, moved by the two emulations' difference where each run
    has its own (`twin_own_emulation`; the same tensor: they share one, and `other` is returned as it is), so that
    the pair's difference is their two deviations from their own emulations, which is what rule 4's twin measures."""
    if other is None or other_emulation is emulation:
        return other
    f64 = lambda t: t.to(emulation.device, torch.float64)  # noqa: E731
    return f64(other) - f64(other_emulation) + f64(emulation)


def twin_judged(truth, twin_truth, out: torch.Tensor | None, emulation: torch.Tensor, twin_emulation: torch.Tensor):
    """(truth, the output it is held to or None) a twin run is judged with (`judge_twins` and the runner's): its own
    truth, alone, where it has one (`twin_own_truth`); else the case's, held to the plain run `out` (`held_to`)."""
    if twin_truth is not None:
        return twin_truth, None
    return truth, held_to(out, emulation, twin_emulation)


def judge_output(case: Case, out: torch.Tensor, truth, emulation: torch.Tensor, precision: str, rules: Rules,
                 before: torch.Tensor | None = None):
    """The verdict on `out` (compare.compare_written): the case's elements (`judging`), the bound of the declared
    model's dtype (a declared TF32 fp32 model is judged at float16's), `rules`. The runner's and selftest --power's."""
    from moe_lora_harness.harness.judge.compare import compare_written
    written, k_plus_r, names = judging(case, truth)
    dt = torch_dtype(case)
    return compare_written(out, truth.value, emulation, truth.scale, written, dtype=bound_dtype(precision, dt),
                           k_plus_r=k_plus_r, before=before, names=names, underflow=truth.underflow, work_dtype=dt,
                           **rules.kwargs(truth))


def judge_twins(case: Case, out: torch.Tensor, twin: torch.Tensor | None, truth, emulation: torch.Tensor,
                precision: str, rules: Rules, twin_emulation: torch.Tensor | None = None, twin_truth=None):
    """`judge_output` of a run and, where it passes, of its twin (`twin_applies`; in the plain columns), each held to
    the other (`held_to`; `twin_emulation`: the twin's own emulation, in the plain columns, where it has one): the
    first failing verdict, else the run's. A twin with its own truth (`twin_truth`, `twin_own_truth`) is judged
    against it alone. The runner's pairing on outputs alone (selftest --power)."""
    if twin is None:
        return judge_output(case, out, truth, emulation, precision, rules)
    own = emulation if twin_emulation is None else twin_emulation
    v = judge_output(case, out, truth, emulation, precision, with_twin(rules, case, held_to(twin, own, emulation)))
    if not v.ok:
        return v
    judged_truth, held = twin_judged(truth, twin_truth, out, emulation, own)
    v2 = judge_output(case, twin, judged_truth, own, precision, with_twin(rules, case, held))
    return v if v2.ok else v2


def with_twin(rules: Rules, case: Case, twin: torch.Tensor | None) -> Rules:
    """`rules` holding a run of `case` to `twin` (the other run of its pair; None: none), with the case's
    `twin_sources`."""
    return rules if twin is None else dataclasses.replace(rules, twin=twin, sources=twin_sources(case))


def row_groups(inputs, truth) -> dict | None:
    """The labellings of the output rows rule 4 also holds for (harness.judge.compare.excess): each token's LoRA slot (-1:
    none) and its routed experts, plain and each row by the inverse of its routing weight to the expert
    (compare.ByInverseWeight), so that a mistake confined to one slot's or one expert's tokens is measured against
    those rows' own allowance. None where rows are not tokens."""
    m = getattr(inputs, "token_lora_mapping", None)
    if m is None or truth.value.dim() < 2 or m.numel() != truth.value.shape[0]:
        return None
    groups = {"LoRA slot": m.reshape(-1)}
    ids = getattr(inputs, "topk_ids", None)
    if ids is not None and ids.dim() == 2 and ids.shape[0] == m.numel():
        groups["routed expert"] = ids
        w = getattr(inputs, "topk_weights", None)
        if w is not None and tuple(w.shape) == tuple(ids.shape):
            groups["weighted routed expert"] = ByInverseWeight(ids, w, "routed expert")
    return groups


def judging(case: Case, truth) -> tuple:
    """(written mask, K+R, index names): what a case's output is compared over."""
    if case.level == "op":
        return truth.written, case.K + case.max_rank, ("t", "j", "col")
    return (torch.ones(truth.value.shape, dtype=torch.bool, device=truth.value.device), case.H + case.I + case.max_rank,
            ("t", "h"))
