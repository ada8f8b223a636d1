"""Expert parallelism with LoRA: TritonExperts (and the Marlin-style int8, OAI-style swigluoai and dual-stream
experts) through NaiveEPPrepareAndFinalize (all-gather dispatch with the token -> LoRA mapping beside the hidden
states, reduce-scatter combine), ranks as SimulatedGroup threads and, once, as two gloo processes. The layers
run on DEVICE: the CPU under the Triton interpreter, else the GPU (both gloo ranks on it). Truth:
reference.sharding's EP forward (`sharded_experts_forward(ep_size=...)`). The error tests check that a rejected
setting, a rank whose layer differs, or one rank's bad argument make EVERY rank raise, without any rank
waiting for the collective timeout.

Error model: each rank's (T_r, H) output is compared with the reference's rows for its tokens by
`compare_written`, truth = exact float64 EP forward, emulation = the same forward under the precision preset
of the LoRA path the experts class takes for the GATHERED batch (what each rank runs), as the harness picks
it (backends' precision_for, dual_stream_precision). The reference models the
combine as one rounding of the float64 sum of the ranks' dt partial outputs; our reduce-scatter adds the ep
partials in fp32 and rounds once, which differs from that by at most (ep - 1) * eps_fp32 * sum|partial|
before the common final rounding. sum|partial| <= scale (the reference's scale is summed over ranks), and
the bound's accumulation term is sqrt(K+R) * eps_fp32 * scale with K+R = H + I + R >= 16 * ep here, so the
extra fp32 sum is covered by that term with room to spare (no widening of the bound is needed).
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import time

import pytest
import torch

from moe_lora_harness.backends.dual_stream import dual_stream_precision
from moe_lora_harness.backends.experts import precision_for
from moe_lora_harness.harness.build.builders import build_expert_inputs
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.judge.compare import compare_written
from moe_lora_harness.harness.execution import fork_server
from moe_lora_harness.harness.execution.communicator import CollectiveError, SimulatedGroup, TorchDistributedCommunicator
from moe_lora_harness.harness.execution.worker import child_env
from moe_lora_harness.kernels.experts.config import MoEConfig
from moe_lora_harness.kernels.experts.dual_stream_experts import DualStreamTritonExperts
from moe_lora_harness.kernels.experts.ep_prepare_finalize import (
    NaiveEPPrepareAndFinalize, ep_local_expert_map, slice_lora_to_local)
from moe_lora_harness.kernels.experts.lora_context import MoELoRAContext
from moe_lora_harness.kernels.experts.marlin_experts import MarlinExperts
from moe_lora_harness.kernels.experts.modular import FusedMoEKernel
from moe_lora_harness.kernels.experts.oai_experts import OAIExperts
from moe_lora_harness.kernels.experts.triton_experts import TritonExperts
from moe_lora_harness.kernels.schedule.recorder import Recorder
from moe_lora_harness.kernels.triton.platform import interpreting
from moe_lora_harness.kernels.triton.quant_gemm import pack_weights
from moe_lora_harness.reference.experts import LoRAInputs
from moe_lora_harness.reference.precision import precision as make_precision
from moe_lora_harness.suites.experts.ep_mutants import CombineTwice, MappingFromStart, OwnMapping
from moe_lora_harness.reference.sharding import (
    ep_expert_map, ep_slice_base, ep_slice_lora, sharded_experts_forward)

H, I, R, L, TOP_K = 32, 32, 8, 3, 2
# where the layers run: Triton kernels need CUDA tensors unless they are interpreted (the judge stays on the CPU)
DEVICE = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
DT = {"float16": torch.float16, "float32": torch.float32}

# ----------------------------------------------------------------------------- the layer and its truth


def _problem(counts, activation, dtype, E, seed=0, quant="none", bias=False):
    """Global inputs for sum(counts) tokens; mapping: rank r's tokens use slot r % L (some -1), so each
    adapter is used by one rank's tokens only and every other rank runs it for them. Quantized weights are
    snapped to the grid (inp.w13/w2 are the dequantized ones the reference uses)."""
    T = sum(counts)
    case = Case(level="expert", T=max(T, 1), H=H, I=I, E=E, top_k=TOP_K, dtype=dtype, max_loras=L, max_rank=R,
                activation=activation, lora=True, seed=seed, quant=quant, bias=bias)
    inp = build_expert_inputs(case)
    parts = []
    for r, c in enumerate(counts):
        m = torch.full((c,), r % L, dtype=torch.int32)
        if c >= 3:
            m[1] = -1
        parts.append(m)
    mapping = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)
    return inp, mapping[:T]


def _preset(inp, counts, experts_cls=TritonExperts, dual_stream=False) -> str:
    """The rounding model of the path experts_cls takes for the GATHERED batch, as the harness picks it
    (backends' precision_for / dual_stream_precision on the dispatched-EP case)."""
    case = inp.case.replace(T=sum(counts), ep_size=len(counts))   # what one rank runs: all tokens, E/ep experts
    return dual_stream_precision(case) if dual_stream else precision_for(experts_cls)(case)


def _reference(inp, mapping, counts, activation, dtype, E, preset=None):
    if preset is None:
        preset = _preset(inp, counts)
    lora = LoRAInputs(inp.stacked, mapping)
    kw = dict(activation=activation, lora=lora, ep_size=len(counts), tokens_per_rank=list(counts),
              w13_bias=inp.w13_bias, w2_bias=inp.w2_bias)
    truth = sharded_experts_forward(inp.hidden, inp.w13, inp.w2, inp.topk_weights, inp.topk_ids,
                                    precision=make_precision("exact", None), **kw)
    emu = sharded_experts_forward(inp.hidden, inp.w13, inp.w2, inp.topk_weights, inp.topk_ids,
                                  precision=make_precision(preset, DT[dtype]), **kw)
    return truth, emu


def _config(activation, dtype, E_local, quant="none", bias=False):
    return MoEConfig(device=DEVICE, dtype=DT[dtype], activation=activation, H=H, I=I, E=E_local, top_k=TOP_K,
                     lora_enabled=True, max_lora_rank=R, expert_map=True, quant=quant, has_bias=bias)


def _rank_layer(comm, inp, mapping, counts, activation, dtype, E, pf_cls=NaiveEPPrepareAndFinalize,
                experts_cls=TritonExperts, dual_stream=False):
    """Rank comm.rank's forward over its own tokens on DEVICE; returns its (T_r, H) output, on the CPU."""
    r, ep = comm.rank, comm.size
    lo, hi = sum(counts[:r]), sum(counts[:r + 1])
    quant, bias = inp.case.quant, inp.case.bias
    cfg = _config(activation, dtype, E // ep, quant, bias)
    pf = pf_cls(comm, E)
    assert torch.equal(pf.expert_map, ep_expert_map(E, ep, r))
    on = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    ons = lambda ts: [on(t) for t in ts]  # noqa: E731
    w13, w2, (b13, b2) = ep_slice_base(inp.w13, inp.w2, (inp.w13_bias, inp.w2_bias), ep_size=ep, ep_rank=r)
    w13, w2 = on(w13), on(w2)
    if quant != "none":   # this rank's experts of the global quantized weights, packed as apply_experts does
        n = E // ep
        q13, s13, q2, s2 = (on(t[r * n:(r + 1) * n].contiguous()) for t in inp.quantized)
        w13, w2 = pack_weights(q13, s13, quant), pack_weights(q2, s2, quant)
    st = inp.stacked
    a13, b13l, a2, b2l = slice_lora_to_local(st.w13_a, st.w13_b, st.w2_a, st.w2_b, ep_rank=r, ep_size=ep)
    ref = ep_slice_lora(st, ep, r)
    assert all(torch.equal(x, y) for x, y in zip(a13 + b13l + a2 + b2l,
                                                 ref.w13_a + ref.w13_b + ref.w2_a + ref.w2_b))
    ctx = MoELoRAContext(w13_lora_a_stacked=ons(a13), w13_lora_b_stacked=ons(b13l), w2_lora_a_stacked=ons(a2),
                         w2_lora_b_stacked=ons(b2l), adapter_enabled=on(st.adapter_enabled.clone()), max_loras=L,
                         top_k=TOP_K, w13_num_slices=len(a13), local_num_experts=E // ep,
                         token_lora_mapping=on(mapping[lo:hi].clone()), dual_stream=dual_stream)
    experts = experts_cls(cfg)
    kernel = FusedMoEKernel(pf, experts)
    out = kernel.apply(on(inp.hidden[lo:hi].clone()), w13, w2, on(inp.topk_weights[lo:hi].clone()),
                       on(inp.topk_ids[lo:hi].clone()), lora_ctx=ctx, expert_map=on(pf.expert_map), w13_bias=on(b13),
                       w2_bias=on(b2))
    if dual_stream:   # the gathered batch really ran on two streams (on the CPU: recorded and race-checked)
        from moe_lora_harness.kernels.schedule.cuda import CudaSchedule
        sched = Recorder if DEVICE == "cpu" else CudaSchedule
        assert experts.last_plan == "both" and isinstance(experts.dual_stream_schedule, sched), experts.last_plan
    return out.cpu()


def _run_threads(group: SimulatedGroup, fn):
    """fn(comm) on every rank (threads taking turns); the root-cause error is re-raised."""
    return group.run(fn, join_timeout_s=120)


def _verdicts(outs, truth, emu, counts, dtype):
    vs = []
    for r, out in enumerate(outs):
        lo, hi = sum(counts[:r]), sum(counts[:r + 1])
        assert tuple(out.shape) == (hi - lo, H) and out.dtype == DT[dtype]
        vs.append(compare_written(out, truth.value[lo:hi], emu.value[lo:hi], truth.scale[lo:hi],
                                  torch.ones(hi - lo, H, dtype=torch.bool), dtype=DT[dtype], k_plus_r=H + I + R))
    return vs


def _ep_run(counts, activation, dtype, E, pf_cls=NaiveEPPrepareAndFinalize, experts_cls=TritonExperts,
            quant="none", bias=False, dual_stream=False):
    inp, mapping = _problem(counts, activation, dtype, E, quant=quant, bias=bias)
    preset = _preset(inp, counts, experts_cls, dual_stream)
    truth, emu = _reference(inp, mapping, counts, activation, dtype, E, preset)
    outs = _run_threads(SimulatedGroup(len(counts)),
                        lambda comm: _rank_layer(comm, inp, mapping, counts, activation, dtype, E, pf_cls,
                                                 experts_cls, dual_stream))
    return _verdicts(outs, truth, emu, counts, dtype)


# ----------------------------------------------------------------------------- correct layer


@pytest.mark.parametrize("counts,activation,dtype,E", [
    ([3, 5], "silu", "float16", 4),
    ([4, 0], "relu2_no_mul", "float32", 4),
    ([2, 0, 5, 1], "silu", "float32", 8),
    ([0, 3, 1, 4], "relu2_no_mul", "float16", 8),
])
def test_ep_layer_matches_reference(counts, activation, dtype, E):
    for r, v in enumerate(_ep_run(counts, activation, dtype, E)):
        assert v.ok, f"rank {r}: {v.kind} {v.message}"


@pytest.mark.parametrize("experts_cls,counts,activation,dtype,E,kw", [
    (MarlinExperts, [3, 0, 2], "silu", "float16", 6, dict(quant="int8_channel")),
    (MarlinExperts, [2, 3], "relu2_no_mul", "float16", 4, dict(quant="int8_channel", bias=True)),
    (OAIExperts, [2, 3], "swigluoai", "float32", 4, dict(bias=True)),
    (OAIExperts, [3, 0, 2], "swigluoai", "float16", 6, {}),
    (DualStreamTritonExperts, [2, 3], "silu", "float16", 4, dict(dual_stream=True)),
    (DualStreamTritonExperts, [3, 0, 2], "relu2_no_mul", "float32", 6, dict(dual_stream=True)),
], ids=["marlin-int8-fp16-3r", "marlin-int8-nogated-bias-2r", "oai-fp32-bias-2r", "oai-fp16-3r",
        "dual_stream-fp16-2r", "dual_stream-nogated-fp32-3r"])
def test_ep_experts_variants_match_reference(experts_cls, counts, activation, dtype, E, kw):
    """The Marlin-style (weight-only int8), OAI-style (swigluoai) and dual-stream experts under the EP
    prepare/finalize, each against the reference under the preset of the path it takes for the gathered batch."""
    cfg = _config(activation, dtype, E // len(counts), kw.get("quant", "none"), kw.get("bias", False))
    ok, why = experts_cls.is_supported_config(cfg)
    assert ok, f"{experts_cls.__name__} declines its own EP config: {why}"
    for r, v in enumerate(_ep_run(counts, activation, dtype, E, experts_cls=experts_cls, **kw)):
        assert v.ok, f"{experts_cls.__name__} rank {r}: {v.kind} {v.message}"


# ----------------------------------------------------------------------------- planted bugs


# the planted prepare/finalize bugs of suites/experts/ep_mutants.py (the harness-level EP suite runs the rest)
@pytest.mark.parametrize("bug", [OwnMapping, MappingFromStart, CombineTwice])
def test_planted_bug_fails(bug):
    vs = _ep_run([3, 4], "silu", "float32", 4, pf_cls=bug)
    assert not all(v.ok for v in vs), f"{bug.__name__} passed the comparison"
    if bug is MappingFromStart:
        assert vs[0].ok and not vs[1].ok   # rank 0's tokens are right, rank 1's are not


# ----------------------------------------------------------------------------- clear errors


def test_construction_errors():
    comm = SimulatedGroup(2).rank_communicator(1)
    with pytest.raises(ValueError, match="fully_sharded"):
        NaiveEPPrepareAndFinalize(comm, 4, fully_sharded=True)
    with pytest.raises(ValueError, match="num_experts_global=5 is not divisible by ep_size=2"):
        NaiveEPPrepareAndFinalize(comm, 5)
    with pytest.raises(ValueError, match="num_experts_global"):
        slice_lora_to_local([torch.zeros(1, 3, 2, 4)], [torch.zeros(1, 3, 4, 2)], [torch.zeros(1, 3, 2, 4)],
                            [torch.zeros(1, 3, 4, 2)], ep_rank=0, ep_size=2)


def test_all2all_backend_and_sequence_parallel_rejected():
    """Only the all-gather / reduce-scatter dispatch is implemented; sequence parallelism with EP is rejected."""
    comm = SimulatedGroup(2).rank_communicator(0)
    for ok in ("naive", "allgather_reducescatter"):
        assert NaiveEPPrepareAndFinalize(comm, 4, all2all_backend=ok).all2all_backend == ok
    with pytest.raises(ValueError, match=r"all2all_backend='deepep_low_latency' is not supported.*supported: "
                                         r"'naive', 'allgather_reducescatter'"):
        NaiveEPPrepareAndFinalize(comm, 4, all2all_backend="deepep_low_latency")
    with pytest.raises(ValueError, match=r"sequence_parallel=True: sequence parallelism with expert parallelism "
                                         r"is not supported"):
        NaiveEPPrepareAndFinalize(comm, 4, sequence_parallel=True)


TIMEOUT_S = 2.0


def _every_rank_raises(size, fn):
    """fn(comm) on `size` SimulatedGroup ranks (collective timeout TIMEOUT_S); each rank's error is caught and
    returned. Asserts every rank raised a ValueError (no CollectiveError) and nobody sat out the timeout."""
    def body(comm):
        try:
            fn(comm)
        except Exception as e:  # noqa: BLE001 - inspected below
            return e
        return None

    t0 = time.monotonic()
    errs = SimulatedGroup(size, timeout_s=TIMEOUT_S).run(body, join_timeout_s=60)
    wall = time.monotonic() - t0
    assert all(isinstance(e, ValueError) for e in errs), f"not every rank raised ValueError: {errs!r}"
    assert wall < TIMEOUT_S, f"ranks waited {wall:.2f}s (>= the {TIMEOUT_S:g}s collective timeout): {errs!r}"
    return [str(e) for e in errs]


@pytest.mark.parametrize("kw,match", [
    (dict(all2all_backend="pplx"), r"all2all_backend='pplx' is not supported"),
    (dict(sequence_parallel=True), r"sequence_parallel=True"),
], ids=["all2all_backend", "sequence_parallel"])
def test_construction_errors_on_every_rank(kw, match):
    """A rejected setting (the same on every rank) raises on every rank at construction, before any collective."""
    for msg in _every_rank_raises(2, lambda comm: NaiveEPPrepareAndFinalize(comm, 4, **kw)):
        assert re.search(match, msg), msg


def test_ep_rank_out_of_range():
    """ep_local_expert_map (and the layer, for a communicator whose rank is outside its group) names ep_rank."""
    msgs = _every_rank_raises(2, lambda comm: ep_local_expert_map(4, comm.size, comm.rank + comm.size))
    assert msgs == [f"ep_rank must be an int in [0, ep_size=2); got {r + 2}" for r in range(2)]
    with pytest.raises(ValueError, match=r"ep_rank must be an int in \[0, ep_size=2\); got -1"):
        ep_local_expert_map(4, 2, -1)

    class _Stray:   # a communicator claiming rank 2 of a group of 2
        rank, size = 2, 2
        all_gather = reduce_scatter = None
    with pytest.raises(ValueError, match=r"ep_rank must be an int in \[0, ep_size=2\); got 2"):
        NaiveEPPrepareAndFinalize(_Stray(), 4)


def _prepare_rank(comm, *, h=H, max_loras=L, rank=R, T=3, mapping_len=None, dtype="float32", hidden_h=None,
                  hidden_dtype=None, lora=True, E=None):
    """One rank's prepare (no experts) with a zero LoRA context; the keywords make this rank's layer differ."""
    ep = comm.size
    E = E or 2 * ep
    cfg = MoEConfig(device="cpu", dtype=DT[dtype], activation="silu", H=h, I=I, E=E // ep, top_k=TOP_K,
                    lora_enabled=lora, max_lora_rank=rank if lora else 0, expert_map=True)
    pf = NaiveEPPrepareAndFinalize(comm, E)
    n = E // ep
    ctx = MoELoRAContext(
        w13_lora_a_stacked=[torch.zeros(max_loras, n, rank, h, dtype=DT[dtype])] * 2,
        w13_lora_b_stacked=[torch.zeros(max_loras, n, I, rank, dtype=DT[dtype])] * 2,
        w2_lora_a_stacked=[torch.zeros(max_loras, n, rank, I, dtype=DT[dtype])],
        w2_lora_b_stacked=[torch.zeros(max_loras, n, h, rank, dtype=DT[dtype])],
        adapter_enabled=torch.ones(max_loras + 1, dtype=torch.int32), max_loras=max_loras, top_k=TOP_K,
        w13_num_slices=2, local_num_experts=n,
        token_lora_mapping=torch.zeros(T if mapping_len is None else mapping_len, dtype=torch.int32)) if lora else None
    hidden = torch.zeros(T, hidden_h or h, dtype=DT[hidden_dtype or dtype])
    pf.prepare(hidden, torch.ones(T, TOP_K), torch.zeros(T, TOP_K, dtype=torch.int32), cfg, lora_ctx=ctx)


def _on(who, **kw):
    """fn(comm): _prepare_rank, with `kw` on rank `who` only."""
    return lambda comm: _prepare_rank(comm, **(kw if comm.rank == who else {}))


@pytest.mark.parametrize("size,bad,kw,want", [
    (2, 1, dict(max_loras=2), "max_loras differs across EP ranks: rank 0: 3, rank 1: 2 (rank(s) [1] disagree "
                              "with rank 0's value 3)"),
    (2, 1, dict(rank=4), "max_lora_rank differs across EP ranks: rank 0: 8, rank 1: 4"),
    (2, 1, dict(h=16), "H differs across EP ranks: rank 0: 32, rank 1: 16"),
    (3, 2, dict(dtype="float16"), "dtype differs across EP ranks: rank 0: torch.float32, rank 1: torch.float32, "
                                  "rank 2: torch.float16 (rank(s) [2] disagree with the most common value "
                                  "torch.float32)"),
    (3, 0, dict(lora=False), "lora differs across EP ranks: rank 0: off, rank 1: on, rank 2: on (rank(s) [0]"),
    (2, 0, dict(E=8), "local_num_experts differs across EP ranks: rank 0: 4, rank 1: 2"),
], ids=["max_loras", "max_rank", "H", "dtype-3r", "lora-3r", "local_experts"])
def test_ranks_disagree_on_the_layer(size, bad, kw, want):
    """A layer signature field that differs on one rank makes every rank raise, naming the field and each
    rank's value, before the dispatch (no rank waits)."""
    for r, msg in enumerate(_every_rank_raises(size, _on(bad, **kw))):
        assert msg.startswith(f"EP prepare (rank {r}): {want}"), msg


@pytest.mark.parametrize("kw,own,field", [
    (dict(mapping_len=2), r"token_lora_mapping \(rank 1\) has length 2; expected this rank's token count T=3",
     "token_lora_mapping"),
    (dict(hidden_h=16), r"hidden_states \(rank 1\) has hidden size 16; expected H=32", "hidden_states"),
], ids=["mapping_length", "hidden_size"])
def test_one_rank_fails_its_checks(kw, own, field):
    """A bad argument on rank 1 only: rank 1 raises its own error, rank 0 says which rank failed which
    argument, and both do so together, through the signature exchange (no rank waits)."""
    m0, m1 = _every_rank_raises(2, _on(1, **kw))
    assert re.fullmatch(own, m1), m1
    assert f"rank 1 failed its argument checks: {field}" in m0, m0


def test_per_rank_argument_errors():
    """The per-rank checks (shape, dtype) name the argument and the rank, with every rank failing the same way."""
    for kw, want in ((dict(hidden_h=16), r"hidden_states \(rank {r}\) has hidden size 16"),
                     (dict(hidden_dtype="float16"), r"hidden_states \(rank {r}\) has dtype torch.float16"),
                     (dict(mapping_len=2), r"token_lora_mapping \(rank {r}\) has length 2; expected .* T=3")):
        for r, msg in enumerate(_every_rank_raises(2, lambda comm, kw=kw: _prepare_rank(comm, **kw))):
            assert re.match(want.format(r=r), msg), msg


def test_skipped_collective_raises_quickly():
    group = SimulatedGroup(2, timeout_s=2)

    def fn(comm):
        if comm.rank == 1:
            return None          # skips the collective
        return comm.all_gather([torch.ones(2, 3)])

    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match=r"rank 0: collective all_gather\[1\] .*rank\(s\) \[1\] never joined"):
        _run_threads(group, fn)
    assert time.monotonic() - t0 < 10


class _NoAddNote(RuntimeError):
    """An exception as Python 3.10 makes them: no add_note (PEP 678 came in 3.11)."""

    @property
    def add_note(self):
        raise AttributeError("add_note")


@pytest.mark.parametrize("error", [RuntimeError, _NoAddNote], ids=["add_note", "python-3.10"])
def test_a_ranks_error_carries_its_rank_in_a_note(error):
    """The root-cause error of a simulated rank names its rank in `__notes__` (which the runner appends to the
    failure's message), on Pythons whose exceptions have no add_note too (it was dropped there)."""
    def fn(comm):
        if comm.rank == 1:
            raise error("boom")
        return None

    with pytest.raises(error) as got:
        SimulatedGroup(2, timeout_s=2).run(fn, join_timeout_s=30)
    assert getattr(got.value, "__notes__", None) == ["raised on EP rank 1 of 2"]


def test_simulated_collectives_uneven():
    group = SimulatedGroup(3)

    def fn(comm):
        r = comm.rank
        x = torch.full((r, 2), float(r), dtype=torch.float16)   # 0, 1, 2 rows
        (g,) = comm.all_gather([x])
        part = torch.full((3, 2), 1 / 3, dtype=torch.float16)
        return g, comm.reduce_scatter(part, [0, 1, 2])

    outs = _run_threads(group, fn)
    for r, (g, rs) in enumerate(outs):
        assert torch.equal(g, torch.tensor([[1, 1], [2, 2], [2, 2]], dtype=torch.float16))
        want = (torch.full((3, 2), 1 / 3, dtype=torch.float16).float() * 3).half()[:r] if r else torch.zeros(0, 2)
        assert rs.shape == (r, 2) and rs.dtype == torch.float16
        assert torch.equal(rs, want.to(torch.float16))


# ----------------------------------------------------------------------------- real processes (gloo)

_GLOO = dict(counts=[3, 2], activation="silu", dtype="float32", E=4)


def _gloo_worker(rank, world, port, outdir):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        inp, mapping = _problem(_GLOO["counts"], _GLOO["activation"], _GLOO["dtype"], _GLOO["E"])
        out = _rank_layer(TorchDistributedCommunicator(), inp, mapping, _GLOO["counts"], _GLOO["activation"],
                          _GLOO["dtype"], _GLOO["E"])
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gloo_two_processes(tmp_path):
    """Both ranks on DEVICE (on a GPU, gloo moves the CUDA tensors of one GPU between the two processes), each
    a process of the harness's fork server, as EP ranks are."""
    port, ranks = _free_port(), []
    for r in range(2):
        with open(tmp_path / f"rank{r}.log", "wb") as log:
            ranks.append(fork_server.start(f"{__name__}:_gloo_worker", (r, 2, port, str(tmp_path)), env=child_env(),
                                           output=log.fileno()))
    codes = []
    for p in ranks:
        try:
            codes.append(p.wait(timeout=120))
        except subprocess.TimeoutExpired:
            for q in ranks:
                q.kill()
                q.wait()
            pytest.fail("gloo ranks did not finish within 120 s")
    assert codes == [0, 0], [codes] + [(tmp_path / f"rank{r}.log").read_text()[-2000:] for r in range(2)]
    inp, mapping = _problem(_GLOO["counts"], _GLOO["activation"], _GLOO["dtype"], _GLOO["E"])
    truth, emu = _reference(inp, mapping, _GLOO["counts"], _GLOO["activation"], _GLOO["dtype"], _GLOO["E"])
    outs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r, v in enumerate(_verdicts(outs, truth, emu, _GLOO["counts"], _GLOO["dtype"])):
        assert v.ok, f"rank {r}: {v.kind} {v.message}"
