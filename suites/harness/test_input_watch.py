"""The worker's watch over the tensors handed to a backend (harness.execution.execute.InputWatch): a tensor over
SNAPSHOT_MAX_BYTES is watched by its digest instead of a copy (a served layer's weights are not held a third time),
and a write into it is caught as one into a copied tensor is; the memory estimate counts the snapshot so."""
from __future__ import annotations

import pytest
import torch

from moe_lora_harness.harness.build.case_memory import DIGEST_WORK, FIXED, INPUT_COPIES, memory_need
from moe_lora_harness.harness.build.guards import SNAPSHOT_MAX_BYTES
from moe_lora_harness.harness.execution import execute
from moe_lora_harness.harness.execution.runner import run_case
from moe_lora_harness.harness.judge.tensor_digest import CHUNK_WORDS, lane_sums
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.registry import load_ref

HOSTILE = {s.name: s for s in load_ref("moe_lora_harness.suites.harness.hostile_backends:HOSTILE")}


@pytest.mark.parametrize("how", ["copied", "sha1", "lane-sums"])
def test_a_write_into_a_watched_tensor_is_seen_to_the_bit(how, monkeypatch):
    """One changed element, a zero's sign, a NaN's payload, an index off by one: each names its tensor, whether the
    watch copied it or digested it (sha1 on the CPU; a GPU's lane sums, run here on the CPU tensors); the output is
    not watched, and an untouched tensor is not named."""
    monkeypatch.setattr(execute, "SNAPSHOT_MAX_BYTES", 1 << 40 if how == "copied" else 0)
    if how == "lane-sums":
        monkeypatch.setattr(execute, "inputs_digest", lambda t: lane_sums(t).numpy().tobytes())
    g = torch.Generator().manual_seed(0)
    a, z, n = torch.randn(64, 33, generator=g, dtype=torch.float16), torch.zeros(7), torch.full((5,), float("nan"))
    ids, out = torch.arange(10, dtype=torch.int32), torch.zeros(3)
    writes = {"a": lambda: a.view(torch.int16)[17, 5].add_(1), "z": lambda: z.__setitem__(6, -0.0),
              "n": lambda: n.view(torch.int32)[2].add_(1), "ids": lambda: ids[9].add_(1)}
    for name, write in writes.items():
        watch = execute.InputWatch()
        watch.add("", {"a": a, "z": z, "n": n, "ids": ids, "output": out})
        assert watch.written() == []
        out.add_(1.0)
        write()
        assert watch.written() == [name], name


def test_the_worker_names_an_input_it_digested_as_written(monkeypatch):
    """End to end in one process: with every input digested, a backend that writes its x or its LoRA A after a
    correct call fails 'input-written' naming the tensor, and the correct control passes."""
    monkeypatch.setattr(execute, "SNAPSHOT_MAX_BYTES", 0)
    case = Case(T=3, H=24, I=16, E=4, top_k=2, max_rank=4, which="w2", num_slices=1, mul_routed_weight=True, seed=7)
    for name, tensor in (("hostile-writes-x", "qcurr_hidden_states"), ("hostile-writes-lora-a", "lora_a_stacked[0]")):
        out = run_case(HOSTILE[name], case, "cpu", executor=execute.InProcess(), reruns=0)
        assert out.status == "fail" and out.kind == "input-written" and tensor in out.detail, (name, out.detail)
    assert run_case(HOSTILE["hostile-control"], case, "cpu", executor=execute.InProcess()).status == "pass"


def test_the_estimate_counts_digested_tensors_once():
    """At DeepSeek-V3's layer with FP8 weights the weights and their codes (31.5 GiB) are held by the judge and the
    backend, not snapshotted (the digest's temporaries counted instead), and the weights as drawn (21 GiB in bf16) are
    alive once more while the worker draws them beside the judge's copy: the case needs more than an H100's 78 GiB
    (where it ran out of memory, fifty-fifth session) and less than an H200's 139; sharded ranks and small cases count
    every tensor copied, as before."""
    layer = dict(level="expert", E=256, H=7168, I=2048, top_k=8, max_loras=3, max_rank=32, dtype="bfloat16")
    fp8 = memory_need(Case(T=176, call_tokens=16, quant="fp8_block", **layer), "cuda")
    drawn = 2 * 256 * (2 * 2048 * 7168 + 7168 * 2048)                       # bf16
    weights = drawn + 256 * 3 * 2048 * 7168                                  # and the codes
    assert fp8.digested == weights and fp8.guarded == 0 and fp8.building == drawn
    assert fp8.total == INPUT_COPIES * fp8.inputs - weights + DIGEST_WORK + fp8.reference + FIXED + drawn
    assert 78 * 2**30 < fp8.total < 139 * 2**30
    assert DIGEST_WORK >= 6 * 8 * CHUNK_WORDS
    text = fp8.describe()
    assert "2 x 32.77 GiB of inputs" in text and "31.50 GiB in tensors over 256 MiB digested" in text, text
    assert f"{fp8.total / 2**30:.2f} GiB" in text and "for the float64 reference and the digest" in text
    assert "21.00 GiB while the inputs are drawn" in text, text
    assert memory_need(Case(T=176, tp_size=2, quant="fp8_block", **layer), "cuda").digested == 0
    small = memory_need(Case(level="expert", T=16, H=256, I=128, E=8, top_k=2), "cpu")
    assert small.digested == 0 and f"{INPUT_COPIES + 1} x" in small.describe()
    assert SNAPSHOT_MAX_BYTES == 256 << 20
