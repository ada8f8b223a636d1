"""The judge on a CUDA device (the lead's GPU lane): a case's inputs are drawn on the GPU, the same in every
process; the judge's float64 truth there is the CPU's truth of the same tensors to float64 rounding; the device
digest is the CPU's integers; a supervised run is judged on the GPU; the judge lets go of the layer afterwards."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from moe_lora_harness.harness.build.builders import build_expert_inputs, build_op_inputs, torch_dtype
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.execution.execute import _tensors, inputs_digest
from moe_lora_harness.harness.judge.expectation import op_expectations, op_reference
from moe_lora_harness.harness.build.expert_runner import expert_expectations, expert_forward
from moe_lora_harness.harness.judge.tensor_digest import lane_sums
from moe_lora_harness.reference.precision import precision

from .judge_golden import CASES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

OP = [c for c in CASES if c.level == "op"]
EXPERT = [c for c in CASES if c.level == "expert"]


def _build(case, device):
    return build_op_inputs(case, device) if case.level == "op" else build_expert_inputs(case, device)


def _to_cpu(obj):
    """A built record (or StackedMoELoRA) with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_cpu(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _to_cpu(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                                           if f.init and f.name != "case"})
    return obj


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_cuda_case_is_drawn_on_the_gpu_and_repeats(case):
    a, b = _build(case, "cuda"), _build(case, "cuda")
    named = [(n, t) for n, t in _tensors(a)]
    assert all(t.is_cuda for n, t in named if n != "num_active_loras"), [n for n, t in named if not t.is_cuda]
    assert inputs_digest(a).startswith("device:") and inputs_digest(a) == inputs_digest(b)
    cpu = _build(case, "cpu")
    main = "x" if case.level == "op" else "hidden"
    if case.T:
        assert not torch.equal(getattr(a, main).cpu(), getattr(cpu, main))     # the GPU's own draw


def test_two_processes_draw_the_same_case():
    """A fresh process (the worker's situation) digests a case built on its GPU as this one does."""
    picks = [OP[0], OP[1], EXPERT[0], EXPERT[4]]
    code = ("import sys\nfrom moe_lora_harness.harness.spec.case import Case\n"
            "from moe_lora_harness.harness.build.builders import build_op_inputs, build_expert_inputs\n"
            "from moe_lora_harness.harness.execution.execute import inputs_digest\n"
            "for js in sys.argv[1:]:\n    c = Case.from_json(js)\n"
            "    b = build_op_inputs(c, 'cuda') if c.level == 'op' else build_expert_inputs(c, 'cuda')\n"
            "    print(inputs_digest(b))\n")
    out = subprocess.run([sys.executable, "-c", code, *[c.to_json() for c in picks]], capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == [inputs_digest(_build(c, "cuda")) for c in picks]


def test_the_device_digest_is_the_cpus_integers():
    """Lane sums of CUDA tensors equal those of the same tensors on the CPU; a changed element changes them."""
    inp = build_expert_inputs(EXPERT[0], "cuda")
    for name, t in _tensors(inp):
        assert torch.equal(lane_sums(t).cpu(), lane_sums(t.cpu())), name
    before = lane_sums(inp.w13).cpu()
    inp.w13.view(torch.int16)[0, 0, 0] ^= 1
    assert not torch.equal(lane_sums(inp.w13).cpu(), before)


def _close(gpu, cpu, scale, what):
    """float64 values that differ only by the order of float64 sums: within 1e-12 of their error magnitude."""
    gpu = gpu.cpu()
    tol = 1e-12 * scale.abs() + 1e-300
    bad = ((gpu - cpu).abs() > tol) & ~(gpu.isnan() & cpu.isnan())
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} elements differ beyond float64 rounding"


@pytest.mark.parametrize("case", EXPERT, ids=lambda c: c.id)
def test_cuda_truth_is_the_cpu_truth_of_the_same_tensors(case):
    inp, truth, emu = expert_expectations(case, "one_shot", device="cuda")
    assert truth.value.is_cuda and emu.value.is_cuda
    cpu = _to_cpu(inp)
    forward, args, kw = expert_forward(case, cpu)
    want = forward(*args, precision=precision("exact", None), **kw)
    for field in ("value", "scale", "underflow"):
        _close(getattr(truth, field), getattr(want, field), want.scale + getattr(want, field).abs(), field)
    want_emu = forward(*args, precision=precision("one_shot", torch_dtype(case)), magnitudes=False, **kw).value
    # an emulation rounds to the dtype: a float64 difference can move a value across a rounding boundary (rare)
    eps = torch.finfo(torch_dtype(case)).eps
    assert bool(((emu.value.cpu() - want_emu).abs() <= 4 * eps * want.scale + 1e-300).all())
    assert float((emu.value.cpu() == want_emu).double().mean()) > 0.99


@pytest.mark.parametrize("case", OP, ids=lambda c: c.id)
def test_cuda_op_truth_is_the_cpu_truth_of_the_same_tensors(case):
    inputs, truth, _ = op_expectations(case, "one_shot", "cuda")
    want = op_reference(case, _to_cpu(inputs))
    assert torch.equal(truth.written.cpu(), want.written)
    _close(truth.value, want.value, want.scale + want.value.abs(), "value")


def test_a_supervised_cuda_run_is_judged_where_it_is_drawn():
    """The worker draws the inputs where the judge does (digest match: pass): a small case on the CPU (copied to the
    GPU for the backend; judged on the CPU), a larger one on the GPU; an input write is seen; a GPU judge keeps no
    inputs after its reference."""
    from moe_lora_harness.harness.build.builders import draw_device
    from moe_lora_harness.harness.spec.registry import load_ref
    from moe_lora_harness.harness.execution.runner import expectations, run_case
    from moe_lora_harness.harness.execution.worker import Supervisor
    eager = {s.name: s for s in load_ref("moe_lora_harness.backends:BUILTINS")}["eager"]
    hostile = {s.name: s for s in load_ref("moe_lora_harness.suites.harness.hostile_backends:HOSTILE")}
    w2 = Case(T=3, H=24, I=16, E=4, top_k=2, max_rank=4, which="w2", num_slices=1, mul_routed_weight=True, seed=7)
    big = Case(level="expert", T=64, H=1024, I=512, E=16, top_k=2, dtype="bfloat16", seed=5)
    assert draw_device(big, "cuda").type == "cuda" and draw_device(EXPERT[0], "cuda").type == "cpu"
    with Supervisor(timeout=120) as sup:
        for case in (OP[0], OP[1], EXPERT[0], EXPERT[3], big):
            out = run_case(eager, case, "cuda", executor=sup, reruns=0)
            assert out.status == "pass", out.detail
        out = run_case(hostile["hostile-writes-x"], w2, "cuda", executor=sup, reruns=0)
        assert out.kind == "input-written", out.detail
    exp = expectations(eager, big, "cuda")
    assert exp.built is None and exp.truth.value.is_cuda
    assert inputs_digest(exp.inputs) == exp.digest            # rebuilt on demand, bit for bit
    small = expectations(eager, EXPERT[0], "cuda")
    assert small.built is not None and not small.truth.value.is_cuda


def test_the_judge_lets_go_of_the_layer():
    """After its reference the judge holds the (T, H) results, not the layer's weights."""
    from moe_lora_harness.harness.spec.registry import load_ref
    from moe_lora_harness.harness.execution.runner import expectations
    eager = {s.name: s for s in load_ref("moe_lora_harness.backends:BUILTINS")}["eager"]
    case = Case(level="expert", T=64, H=1024, I=512, E=64, top_k=4, dtype="bfloat16", seed=3)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    exp = expectations(eager, case, "cuda")
    held = torch.cuda.memory_allocated() - base
    weights = 2 * case.E * 3 * case.H * case.I                       # w13 + w2 in bf16
    assert held < weights / 4, (held, weights)
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() < weights  # cached blocks handed back
    del exp


def test_rounding_is_the_same_on_the_gpu():
    """rnd and the operand formats give the CPU's bits on the GPU (the ulp is written as bits, not CUDA's pow; float16
    and bfloat16 by CUDA's casts, held to the exponent definition as well)."""
    from moe_lora_harness.reference.precision import rnd, rnd_format
    x = torch.randn(64, 257, dtype=torch.float64) * torch.logspace(-45, 40, 257, dtype=torch.float64)
    x[0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0], dtype=torch.float64)
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        assert torch.equal(rnd(x.cuda(), dt).cpu().view(torch.int64), rnd(x, dt).view(torch.int64)), dt
    for fmt in ("tf32", "tf32rz", "bf16", "fp16"):
        assert torch.equal(rnd_format(x.cuda(), fmt).cpu().view(torch.int64), rnd_format(x, fmt).view(torch.int64))
    # float16 and bfloat16 are rounded by CUDA's casts (to odd through float32): the definition's bits, next to
    # ties and in the subnormals too (the rounding test's values)
    from moe_lora_harness.reference.precision import _OPERAND_FORMATS
    from moe_lora_harness.suites.reference.test_rounding import _values, assert_definition_bits
    for fmt in ("bf16", "fp16"):
        form = _OPERAND_FORMATS[fmt]
        v = _values(*form[:2])
        assert_definition_bits(v, rnd_format(v.cuda(), fmt).cpu(), form)      # NaN payloads kept, as on the CPU


def test_a_long_case_is_judged_in_token_chunks(monkeypatch):
    """Past token_chunk(case) tokens a CUDA judge computes in pieces: the same truth to float64 rounding, the same
    emulation but where a float64 difference crosses a rounding boundary."""
    from moe_lora_harness.harness.build import expert_runner
    case = Case(level="expert", T=300, H=256, I=128, E=16, top_k=4, max_loras=3, max_rank=16, mapping="mixed",
                dtype="bfloat16", bias=True, seed=9)
    inp = build_expert_inputs(case, "cuda")
    forward, args, kw = expert_forward(case, inp)
    assert forward is expert_runner.moe_experts_forward
    whole = forward(*args, precision=precision("exact", None), **kw)
    monkeypatch.setattr(expert_runner, "PAIR_VALUES_PER_CHUNK", 40 * case.top_k * (2 * case.I + case.I + case.H))
    forward, args, kw = expert_forward(case, inp)
    assert forward is not expert_runner.moe_experts_forward and expert_runner.token_chunk(case) == 40
    parts = forward(*args, precision=precision("exact", None), **kw)
    for field in ("value", "scale", "underflow"):
        _close(getattr(parts, field).cpu(), getattr(whole, field).cpu(), whole.scale.cpu(), field)
