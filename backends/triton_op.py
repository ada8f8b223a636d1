"""Our Triton MoE-LoRA op (kernels/triton): the dispatch and each path as its own backend.

On a machine without CUDA the kernels run in the Triton interpreter, which cannot do bf16 arithmetic
(it computes on bit patterns; Triton issue 11584), so bf16 is declared unsupported on the CPU.
"""
from __future__ import annotations

from moe_lora_harness.backends.rounding import TRITON_POINTS_ONLY
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.contract import BackendSpec, Capabilities, Rule
from moe_lora_harness.kernels.dtypes import TRITON_DTYPE_REASONS, TRITON_DTYPES

try:
    import triton  # noqa: F401
    from moe_lora_harness.kernels.triton import lora_op as _ops
    _IMPORT_ERROR = ""
except Exception as e:  # noqa: BLE001 - declared, not hidden: every case reports this reason
    _ops, _IMPORT_ERROR = None, f"Triton kernels not importable: {type(e).__name__}: {e}"


def _caps(**kw) -> Capabilities:
    base = dict(
        levels=frozenset({"op"}),
        devices=frozenset() if _ops is None else frozenset({"cpu", "cuda"}),
        dtypes=dict(TRITON_DTYPES),
        dtype_reasons=dict(TRITON_DTYPE_REASONS),
    )
    if _ops is None:
        base["rules"] = (Rule("import", lambda c: False, _IMPORT_ERROR),)
    base.update(kw)
    return Capabilities(**base)


def dispatch_precision(case: Case) -> str:
    """Rounding model of the path our dispatch takes for the case: the one kernels.triton.lora_op.select_path names."""
    if _ops is None:   # never asked for a run: without the kernels the backend declares no device
        return "one_shot"
    return _ops.select_path(naive=case.layout == "naive", max_lora_rank=case.max_rank,
                            num_pairs=case.T * case.top_k, fully_sharded=case.fully_sharded)


def _fn(name):
    def run(*args, **kw):
        return getattr(_ops, name)(*args, **kw)
    run.__name__ = name
    return run


_NOT_FS = Rule("not fully_sharded", lambda c: not c.fully_sharded,
               "the one-shot kernel has no collective between shrink and expand")
_SB_SIZE = Rule("T*k*rank <= 1024", lambda c: c.T * c.top_k * c.max_rank <= 1024,
                "the small-batch kernel is sized for T*k*rank <= 1024")

TRITON = BackendSpec(
    name="triton", description="our Triton op, dispatching like vLLM 0.33.0 (falls back instead of asserting)",
    capabilities=_caps(), op=_fn("fused_moe_lora"), precision=dispatch_precision,
    model_points_only=TRITON_POINTS_ONLY)
TRITON_ONE_SHOT = BackendSpec(
    name="triton_one_shot", description="one-shot fused kernel (shrink+expand in one kernel, rank <= 128)",
    capabilities=_caps(max_rank=128, fully_sharded=False, rules=(_NOT_FS,)) if _ops else _caps(),
    op=_fn("fused_moe_lora_one_shot"), precision="one_shot", model_points_only=TRITON_POINTS_ONLY)
TRITON_SMALL_BATCH = BackendSpec(
    name="triton_small_batch", description="small-batch GEMV kernel (naive layout, rank <= 64, fp32, one rounding)",
    capabilities=_caps(max_rank=64, layouts=frozenset({"naive"}), fully_sharded=False,
                       reasons={("layout", "sorted"): "the small-batch kernel runs one program per (token, slot) "
                                                      "pair of the naive layout and reads no align"},
                       rules=(_NOT_FS, _SB_SIZE)) if _ops else _caps(),
    op=_fn("fused_moe_lora_small_batch"), precision="small_batch", model_points_only=TRITON_POINTS_ONLY)
TRITON_TWO_KERNEL = BackendSpec(
    name="triton_two_kernel", description="two-kernel path (shrink to HBM, collective, expand; any rank)",
    capabilities=_caps(), op=_fn("fused_moe_lora_two_kernel"), precision="two_kernel",
    model_points_only=TRITON_POINTS_ONLY)


def _one_shot_forced(name: str, description: str, device_reasons: dict | None = None, **knobs) -> BackendSpec:
    """The one-shot kernel with the heuristic's launch config overridden by `knobs` at every shape, so the
    conformance suite covers a mode the heuristic picks only at some (e.g. large) shapes. `device_reasons`:
    the devices where forcing them adds nothing, each with why (the backend declines them)."""
    import dataclasses

    def config(call):
        from moe_lora_harness.kernels.triton.one_shot import choose_config
        return dataclasses.replace(choose_config(call), **knobs)

    def op(*args, **kw):
        return _ops.fused_moe_lora_one_shot(*args, **kw, config=config)

    op.__name__ = f"fused_moe_lora_one_shot_{name}"
    devices = {"devices": frozenset({"cpu", "cuda"}) - set(device_reasons), "device_reasons": device_reasons} \
        if device_reasons else {}
    return BackendSpec(
        name=f"triton_one_shot_{name}", description=description,
        capabilities=_caps(max_rank=128, fully_sharded=False, rules=(_NOT_FS,), **devices) if _ops else _caps(),
        op=op, precision="one_shot", model_points_only=TRITON_POINTS_ONLY,
        cpu_rows_in_full_tier="triton_one_shot's kernel with forced knobs (its own tests: suites/kernels)")


# 16-wide K tiles in 3 chunks (fewer when K has fewer tiles).
TRITON_ONE_SHOT_SPLIT_K = _one_shot_forced(
    "split_k", "one-shot kernel forced into split-K at every shape (K chunks in separate programs, the last to "
               "arrive sums them in a fixed order and expands); the heuristic uses it only for a long K",
    split_k=3, block_k=16)
# A 2-deep expand pipeline apart from the shrink's 3 stages and a register cap (128 holds every test tile):
# the launch knobs at values the heuristic does not pick (it uses 3-deep, and 168 for rank <= 32 tiles).
# The interpreter ignores all of them (tl.range's num_stages, num_warps, maxnreg): on the CPU this backend runs
# triton_one_shot's programs bit for bit, so it declines the CPU, with that reason.
TRITON_ONE_SHOT_STREAM = _one_shot_forced(
    "stream", "one-shot kernel forced to a 2-deep expand pipeline and a 128-register cap at every shape "
              "(the heuristic: 3-deep on sorted layouts, cap 168 for rank <= 32 tiles)",
    device_reasons={"cpu": "adds nothing under the Triton interpreter, which ignores the pipeline depths and the "
                           "register cap this backend forces: it would run triton_one_shot's programs bit for bit "
                           "(triton_one_shot's rows run them); on a GPU they are compiled in"},
    num_warps=4, num_stages=3, expand_stages=2, maxnreg=128)

ALL = [TRITON, TRITON_ONE_SHOT, TRITON_ONE_SHOT_SPLIT_K, TRITON_ONE_SHOT_STREAM, TRITON_SMALL_BATCH, TRITON_TWO_KERNEL]
