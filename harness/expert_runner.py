"""Expert-level runs: a backend's (T, H) forward against the float64 reference under the error model."""
from __future__ import annotations

import torch

from harness.builders import build_expert_inputs, torch_dtype
from harness.case import Case
from harness.compare import compare_written
from harness.contract import BackendSpec
from reference.experts import LoRAInputs, moe_experts_forward
from reference.precision import precision as make_precision


def expert_expectations(case: Case, backend_precision: str):
    """(cpu inputs, truth, emulation) for an expert-level case."""
    inp = build_expert_inputs(case)
    lora = LoRAInputs(inp.stacked, inp.token_lora_mapping) if inp.stacked is not None else None
    kw = dict(activation=case.activation, w13_bias=inp.w13_bias, w2_bias=inp.w2_bias, lora=lora,
              expert_map=inp.expert_map, apply_router_weight_on_input=case.apply_router_weight_on_input)
    truth = moe_experts_forward(inp.hidden, inp.w13, inp.w2, inp.topk_weights, inp.topk_ids,
                                precision=make_precision("exact", None), **kw)
    emu = moe_experts_forward(inp.hidden, inp.w13, inp.w2, inp.topk_weights, inp.topk_ids,
                              precision=make_precision(backend_precision, torch_dtype(case)), **kw)
    return inp, truth, emu


def run_expert(spec: BackendSpec, case: Case, device: str):
    """Run the backend's experts on the case; returns (verdict, cpu inputs)."""
    inp, truth, emu = expert_expectations(case, spec.precision_for(case))
    call = inp.call(device)
    spec.experts(call)
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    written = torch.ones(case.T, case.H, dtype=torch.bool)
    verdict = compare_written(call.output, truth.value, emu.value, truth.scale, written,
                              dtype=torch_dtype(case), k_plus_r=case.H + case.I + case.max_rank,
                              names=("t", "h"))
    return verdict, inp
