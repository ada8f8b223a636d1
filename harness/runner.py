"""Run one case against one backend: build inputs, poison, run, reference, compare, explain.

Every failure carries the case as JSON and a `REPRO:` command that replays it alone.
"""
from __future__ import annotations

import shlex
import traceback
from dataclasses import dataclass, field

import torch

from moe_lora_harness.harness.builders import build_op_inputs, torch_dtype
from moe_lora_harness.harness.case import Case
from moe_lora_harness.harness.compare import Verdict, compare_written, format_worst
from moe_lora_harness.harness.contract import BackendSpec, known_bug_for, support_for
from moe_lora_harness.reference.lora_op import fused_moe_lora_expected
from moe_lora_harness.reference.precision import precision as make_precision

STATUSES = ("pass", "fail", "unsupported", "xfail", "xpass", "works-unclaimed")

_TUNING = ("shrink_block_size_m", "shrink_block_size_n", "shrink_block_size_k", "shrink_group_size_m",
           "shrink_num_warps", "shrink_num_stages", "shrink_split_k", "expand_block_size_m",
           "expand_block_size_n", "expand_block_size_k", "expand_group_size_m", "expand_num_warps",
           "expand_num_stages", "expand_split_k")


@dataclass
class Outcome:
    """What happened to one (backend, case) pair."""

    backend: str
    case: Case
    device: str
    status: str
    reason: str = ""
    verdict: Verdict | None = None
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status in ("fail", "xpass")


def repro_command(backend: str, case: Case, device: str, backend_ref: str | None = None) -> str:
    """One shell command that replays this case alone."""
    ref = f" --backend {shlex.quote(backend_ref)}" if backend_ref else ""
    return (f"moe-lora-harness replay{ref} --only {shlex.quote(backend)} --device {device} "
            f"--case {shlex.quote(case.to_json())}")


def _sync(device: str):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _ref_kwargs(inp) -> dict:
    kw = inp.call_kwargs()
    block = kw["shrink_block_size_m"]
    for name in _TUNING:
        kw.pop(name)
    kw.pop("fully_sharded")
    return dict(kw, block_size_m=block)


def op_expectations(case: Case, backend_precision: str):
    """(cpu inputs, truth, emulation) for an op-level case."""
    cpu = build_op_inputs(case, "cpu")
    kw = _ref_kwargs(cpu)
    truth = fused_moe_lora_expected(**kw, fully_sharded=case.fully_sharded,
                                    precision=make_precision("exact", None))
    emu = fused_moe_lora_expected(**kw, fully_sharded=case.fully_sharded,
                                  precision=make_precision(backend_precision, torch_dtype(case)))
    return cpu, truth, emu


def _op_coords(case: Case, cpu):
    ids, mapping = cpu.topk_ids, cpu.token_lora_mapping

    def coords(idx):
        t, j, col = idx
        s = (col - case.offset) // case.N if col >= case.offset else -1
        return f"expert={int(ids[t, j])} lora={int(mapping[t])} slice={s}"
    return coords


def _expert_coords(inp):
    ids, mapping = inp.topk_ids, inp.token_lora_mapping

    def coords(idx):
        t = idx[0]
        return f"experts={ids[t].tolist()} lora={int(mapping[t])}"
    return coords


def run_op(spec: BackendSpec, case: Case, device: str):
    """Run the backend's op on the case; returns (verdict, cpu inputs) or raises what the backend raised."""
    cpu, truth, emu = op_expectations(case, spec.precision_for(case))
    inp = cpu.to(device) if str(device) != "cpu" else build_op_inputs(case, "cpu")
    if not case.add_inputs:   # the contract does not read these: poison them so a missed write shows
        inp.output[truth.written.to(inp.output.device)] = float("nan")
    before = inp.output.clone()
    spec.op(**inp.call_kwargs())
    _sync(device)
    verdict = compare_written(inp.output, truth.value, emu.value, truth.scale, truth.written,
                              dtype=torch_dtype(case), k_plus_r=case.K + case.max_rank, before=before)
    return verdict, cpu


def run_case(spec: BackendSpec, case: Case, device: str = "cpu", *, probe: bool = False,
             backend_ref: str | None = None) -> Outcome:
    """Judge one case: unsupported (with the declared reason), pass, fail, xfail/xpass per the ledger.

    With `probe`, a case the backend declines is run anyway; if it passes the outcome is
    `works-unclaimed` (reported, not a failure).
    """
    if backend_ref is None and spec.origin:
        from moe_lora_harness.harness.registry import is_registered
        if not is_registered(spec):   # a user backend: the replay must load it again
            backend_ref = spec.origin
    ok, reason = support_for(spec, case, device)
    if not ok and not probe:
        return Outcome(spec.name, case, device, "unsupported", reason)
    runner = {"op": run_op, "expert": _run_expert}[case.level]
    try:
        verdict, cpu = runner(spec, case, device)
        err = None
    except Exception as e:  # noqa: BLE001 - a claimed case that raises is a failure we report in full
        verdict, cpu, err = None, None, e
    if not ok:   # probing an unclaimed case
        if err is None and verdict.ok:
            return Outcome(spec.name, case, device, "works-unclaimed",
                           f"declared unsupported ({reason}) but passes", verdict)
        return Outcome(spec.name, case, device, "unsupported", reason, verdict)
    bug = known_bug_for(spec, case)
    passed = err is None and verdict.ok
    if bug is not None:
        if passed:
            return Outcome(spec.name, case, device, "xpass",
                           f"known bug {bug.issue} ({bug.description}) did not reproduce: close the ledger entry",
                           verdict, _explain(spec, case, device, verdict, None, cpu, backend_ref))
        return Outcome(spec.name, case, device, "xfail", f"known bug {bug.issue}: {bug.description}", verdict)
    if passed:
        return Outcome(spec.name, case, device, "pass", "", verdict)
    return Outcome(spec.name, case, device, "fail", verdict.kind if verdict else type(err).__name__, verdict,
                   _explain(spec, case, device, verdict, err, cpu, backend_ref))


def _explain(spec, case, device, verdict, err, cpu, backend_ref) -> str:
    lines = [f"FAIL backend={spec.name} case={case.id} device={device}"]
    if err is not None:
        lines.append(f"  raised {type(err).__name__}: {err}")
        lines.append("  " + "".join(traceback.format_exception(err)[-3:]).strip().replace("\n", "\n  "))
    else:
        lines.append(f"  {verdict.kind}: {verdict.message}")
        if verdict.worst:
            coords = None
            if cpu is not None:
                coords = _op_coords(case, cpu) if case.level == "op" else _expert_coords(cpu)
            names = ("t", "j", "col") if case.level == "op" else ("t", "h")
            lines.append(format_worst(verdict, names, coords))
    lines.append(f"CASE: {case.to_json()}")
    lines.append(f"REPRO: {repro_command(spec.name, case, device, backend_ref)}")
    return "\n".join(lines)


def _run_expert(spec: BackendSpec, case: Case, device: str):
    from moe_lora_harness.harness.expert_runner import run_expert
    return run_expert(spec, case, device)
