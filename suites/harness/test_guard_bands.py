"""Guard bands (harness.build.guards): every tensor handed to a backend lies between poisoned bands, so a read
past an end brings NaN (or an integer 1) into the kernel and a write past an end is reported; the copy keeps the
tensor's values, shape, strides and shared memory."""
from __future__ import annotations

import os

import pytest
import torch

from moe_lora_harness.harness.build import guards
from moe_lora_harness.harness.build.guards import GUARD, Bands, guard


def _past(t: torch.Tensor, n: int = 1) -> torch.Tensor:
    """The n elements after a contiguous tensor's last, read through its storage."""
    return t.as_strided((t.numel() + n,), (1,), t.storage_offset())[t.numel():]


SHAPES = {
    "contiguous": lambda: torch.randn(5, 7),
    "transposed": lambda: torch.randn(7, 5).t(),
    "sliced": lambda: torch.randn(6, 9)[1:5, 2:7],
    "stride 0 (one factor for every expert)": lambda: torch.randn(1, 3, 4).expand(5, 3, 4),
    "float16": lambda: torch.randn(4, 6).half(),
    "fp8": lambda: torch.randn(4, 6).to(torch.float8_e4m3fn),
    "int32": lambda: torch.arange(12, dtype=torch.int32).reshape(3, 4),
    "bool": lambda: torch.tensor([True, False, True]),
}


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_the_copy_is_the_tensor(kind):
    t = SHAPES[kind]()
    g = guard("t", t)
    assert g.view.shape == t.shape and g.view.stride() == t.stride() and g.view.dtype == t.dtype
    assert torch.equal(g.view.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else g.view,
                       t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)
    assert g.written() == ""
    if 0 in t.stride():        # shared memory stays shared: one write shows in every expert's view
        g.view[0, 0, 0] = 3.0
        assert float(g.view[4, 0, 0]) == 3.0 and g.written() == ""


def test_a_read_past_either_end_brings_poison():
    g = guard("x", torch.randn(10))
    assert torch.isnan(_past(g.view, GUARD)).all()
    assert torch.isnan(g.view.as_strided((1,), (1,), g.view.storage_offset() - 1)).all()
    ids = guard("ids", torch.zeros(4, dtype=torch.int32))
    assert _past(ids.view).tolist() == [1]      # a valid slot, expert, pair and an enabled flag


def test_a_strided_views_gaps_are_poisoned():
    g = guard("half", torch.randn(4, 8)[:, :4])
    assert torch.isnan(g.view.as_strided((4,), (1,), g.view.storage_offset() + 4)).all()


def test_writes_outside_are_reported_where_they_fell():
    g = guard("output", torch.randn(3, 4))
    _past(g.view, 2)[:] = 0.0
    assert g.written() == "output: 2 element(s) past its last"
    g.view.as_strided((1,), (1,), g.view.storage_offset() - 1)[0] = 1.0
    assert g.written() == "output: 1 element(s) before its first, 2 element(s) past its last"
    s = guard("w", torch.randn(4, 8)[:, :4])
    s.view.as_strided((1,), (1,), s.view.storage_offset() + 5)[0] = 0.0
    assert s.written() == "w: 1 element(s) between its strided elements"


def test_a_nan_write_into_a_band_still_shows():
    """The bands are compared as bits: a NaN of another payload written there is a write."""
    g = guard("o", torch.randn(4))
    _past(g.view).view(torch.int32)[0] = 0x7FC00001
    assert "1 element(s) past its last" in g.written()


def test_lists_are_guarded_each_and_big_calls_are_not(monkeypatch):
    bands = Bands()
    a, b = torch.randn(3), torch.randn(2)
    wrapped = bands.wrap("lora_a", [a, b])
    assert [torch.equal(w, t) for w, t in zip(wrapped, (a, b))] == [True, True]
    assert [g.name for g in bands.guarded] == ["lora_a[0]", "lora_a[1]"]
    assert bands.wrap("n", 3) == 3 and bands.wrap("none", None) is None
    monkeypatch.setattr(guards, "GUARD_MAX_BYTES", 7)
    (kw,), (off,) = guards.guard_fields([{"x": a[:2]}], [""])     # 8 bytes: over the limit, handed over as it is
    assert not off.enabled and kw["x"] is not None and kw["x"].data_ptr() == a.data_ptr()


def test_ranks_calls_are_guarded_together_or_not_at_all(monkeypatch):
    """One decision for every rank's call (their tensors together, as case_memory counts the guarded copies); each
    name says its rank."""
    calls = [{"x": torch.randn(3), "w": [torch.randn(2)]}, {"x": torch.randn(3), "w": [torch.randn(2)]}]
    _, bands = guards.guard_fields(calls, ["rank0.", "rank1."])
    assert [g.name for b in bands for g in b.guarded] == ["rank0.x", "rank0.w[0]", "rank1.x", "rank1.w[0]"]
    monkeypatch.setattr(guards, "GUARD_MAX_BYTES", 39)           # each rank's 20 bytes fit; the two together not
    _, bands = guards.guard_fields(calls, ["rank0.", "rank1."])
    assert not any(b.enabled for b in bands)


@pytest.mark.parametrize("ranks", ['"ep_size":2,"ep_tokens":[3,4],"E":8', '"ep_size":2,"ep_tokens":[3,4],"E":8,'
                                   '"ep_comm":"processes"', '"tp_size":2',
                                   '"tp_size":2,"fully_sharded":true,"max_rank":8,"ranks":[8,4]'])
def test_a_write_past_an_ep_or_tp_ranks_output_is_reported(ranks, device):
    """Each EP or TP rank's call lies between bands too (an EP rank run as a process guards its own): a store past
    one rank's output (unguarded, it would land in the next rank's rows or in memory no one reads) is
    `outside-written`, naming the rank."""
    from moe_lora_harness.harness.execution.ep_ranks import driver_problem
    from moe_lora_harness.harness.execution.execute import execute
    from moe_lora_harness.harness.spec.case import Case
    from moe_lora_harness.harness.spec.registry import available_backends, load_ref
    pytest.importorskip("triton")
    case = Case.from_json('{"level":"expert","T":7,"H":32,"I":32,"dtype":"float32",' + ranks + '}')
    assert not case.problems()
    if driver_problem(case, device):
        pytest.skip(driver_problem(case, device))
    correct = available_backends()["triton_experts"]      # runs dispatched EP (simulated, processes) and both TPs
    assert execute(correct, case, device).outside_written == []
    (hostile,) = load_ref("moe_lora_harness.suites.harness.rank_hostile_backends:RANK_HOSTILE")   # the ranks load it
    got = execute(hostile, case, device)
    assert got.failure is None and got.outside_written
    assert all(w.startswith("rank") and "output" in w and "1 element(s) past its last" in w
               for w in got.outside_written), got.outside_written


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's reads are what this shows")
def test_the_triton_interpreter_reads_the_band():
    """Why the bands matter on a CPU: the interpreter reads real memory past a tensor (an unguarded tensor's
    neighbours are mostly zeros, so a tail read without its mask would pass)."""
    triton = pytest.importorskip("triton")
    tl = pytest.importorskip("triton.language")

    @triton.jit
    def tail_without_mask(x_ptr, o_ptr, B: tl.constexpr):
        offs = tl.arange(0, B)
        tl.store(o_ptr + offs, tl.load(x_ptr + offs))

    g = guard("x", torch.arange(10.0))
    out = torch.zeros(16)
    tail_without_mask[(1,)](g.view, out, B=16)
    assert torch.equal(out[:10], torch.arange(10.0)) and torch.isnan(out[10:]).all()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="a Triton kernel, run in the interpreter")
def test_a_dropped_slot_check_fails_between_the_bands():
    """Found by bench/mutation_score.py: our grid's `lora >= 0` check dropped, a token without an adapter (slot -1)
    reads adapter_enabled[-1] and then its A at slot -1: memory before the tensors. Unguarded, the interpreter
    read 0 there (malloc's bookkeeping, on this machine) and the kernel passed every check row; between the bands
    it reads an enabled flag and NaN, and the untouched rows of tokens without an adapter change. (The unguarded
    pass is not asserted: what lies before an unguarded tensor is the allocator's.)"""
    pytest.importorskip("triton")
    from moe_lora_harness.backends.triton_op import TRITON_ONE_SHOT
    from moe_lora_harness.harness.execution.execute import InProcess
    from moe_lora_harness.harness.execution.runner import run_case
    from moe_lora_harness.harness.spec.case import Case
    from moe_lora_harness.kernels.triton import program_pairs
    from moe_lora_harness.suites.kernels.source_mutants import Edit, installed, mutated
    dropped = mutated(program_pairs.resolve_lora_expert,
                      [Edit("in_range = (lora >= 0) & (lora < max_loras)", "in_range = lora < max_loras")],
                      tag="slot-check-dropped")
    case = Case.from_json('{"I":48,"T":6,"mapping":"mixed","max_loras":3,"seed":1055}')
    with installed((program_pairs.resolve_lora_expert, dropped)):
        out = run_case(TRITON_ONE_SHOT, case, "cpu", executor=InProcess(), reruns=0, diagnose=False)
    assert out.status == "fail" and out.kind == "untouched", (out.status, out.kind, out.detail)
    assert run_case(TRITON_ONE_SHOT, case, "cpu", executor=InProcess(), reruns=0).status == "pass"   # the original


class _StoresPast:
    """A layer that runs `inner` and then stores one element past the end of what `where` names in its batch
    ("hidden_states") or its weights ("w2")."""

    def __init__(self, inner, weights, where: str):
        self._inner, self._weights, self._where = inner, weights, where

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def forward(self, b):
        out = self._inner.forward(b)
        t = getattr(b, self._where) if self._where == "hidden_states" else getattr(self._weights, self._where)
        t.as_strided((t.numel() + 1,), (1,), t.storage_offset())[-1] = 0
        return out


@pytest.mark.parametrize("where", ["hidden_states", "w2"])
def test_a_layer_writing_past_its_batch_or_weights_fails_that_step(where, device):
    """At the layer level the weights (for the layer's life), each batch and each mapping lie between bands: a
    store past the batch's hidden states or the w2 weights fails the first step that made it, outside-written."""
    import dataclasses
    from moe_lora_harness.harness.layer.layer_runner import run_scenario
    from moe_lora_harness.harness.layer.layer_scenarios import claimed_scenario, layer_scenarios
    from moe_lora_harness.harness.spec.registry import available_backends
    pytest.importorskip("triton")
    correct = available_backends()["layer_triton"]
    hostile = dataclasses.replace(correct, name=f"stores-past-{where}",
                                  layer=lambda config, weights: _StoresPast(correct.layer(config, weights), weights,
                                                                            where))
    label, sc = layer_scenarios(device)[0]
    sc = claimed_scenario(correct, sc, device)
    assert run_scenario(correct, sc, device).status == "pass"
    got = run_scenario(hostile, sc, device)
    assert got.status == "fail" and got.kind == "outside-written", (got.status, got.kind, got.reason)
    name = "batch.hidden_states" if where == "hidden_states" else "weights.w2"
    assert f"{name}: 1 element(s) past its last" in got.reason, got.reason
