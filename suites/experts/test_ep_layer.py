"""Expert parallelism with LoRA: TritonExperts through NaiveEPPrepareAndFinalize (all-gather dispatch with the
token -> LoRA mapping beside the hidden states, reduce-scatter combine), ranks as SimulatedGroup threads and,
once, as two gloo processes. Truth: reference.sharding's EP forward (`sharded_experts_forward(ep_size=...)`).

Error model: each rank's (T_r, H) output is compared with the reference's rows for its tokens by
`compare_written`, truth = exact float64 EP forward, emulation = the same forward under the precision preset
of the LoRA path TritonExperts takes for the GATHERED batch (what each rank runs). The reference models the
combine as one rounding of the float64 sum of the ranks' dt partial outputs; our reduce-scatter adds the ep
partials in fp32 and rounds once, which differs from that by at most (ep - 1) * eps_fp32 * sum|partial|
before the common final rounding. sum|partial| <= scale (the reference's scale is summed over ranks), and
the bound's accumulation term is sqrt(K+R) * eps_fp32 * scale with K+R = H + I + R >= 16 * ep here, so the
extra fp32 sum is covered by that term with room to spare (no widening of the bound is needed).
"""
from __future__ import annotations

import os
import socket
import time

import pytest
import torch

pytest.importorskip("triton")

from moe_lora_harness.harness.builders import build_expert_inputs  # noqa: E402
from moe_lora_harness.harness.case import Case  # noqa: E402
from moe_lora_harness.harness.compare import compare_written  # noqa: E402
from moe_lora_harness.harness.communicator import (  # noqa: E402
    CollectiveError, SimulatedGroup, TorchDistributedCommunicator)
from moe_lora_harness.kernels.experts.config import MoEConfig  # noqa: E402
from moe_lora_harness.kernels.experts.ep_prepare_finalize import (  # noqa: E402
    NaiveEPPrepareAndFinalize, slice_lora_to_local)
from moe_lora_harness.kernels.experts.lora_context import MoELoRAContext  # noqa: E402
from moe_lora_harness.kernels.experts.modular import FusedMoEKernel  # noqa: E402
from moe_lora_harness.kernels.experts.triton_experts import TritonExperts  # noqa: E402
from moe_lora_harness.reference.experts import LoRAInputs  # noqa: E402
from moe_lora_harness.reference.precision import precision as make_precision  # noqa: E402
from moe_lora_harness.reference.sharding import (  # noqa: E402
    ep_expert_map, ep_slice_base, ep_slice_lora, sharded_experts_forward)

H, I, R, L, TOP_K = 32, 32, 8, 3, 2
DT = {"float16": torch.float16, "float32": torch.float32}

# ----------------------------------------------------------------------------- the layer and its truth


def _problem(counts, activation, dtype, E, seed=0):
    """Global inputs for sum(counts) tokens; mapping: rank r's tokens use slot r % L (some -1), so each
    adapter is used by one rank's tokens only and every other rank runs it for them."""
    T = sum(counts)
    case = Case(level="expert", T=max(T, 1), H=H, I=I, E=E, top_k=TOP_K, dtype=dtype, max_loras=L, max_rank=R,
                activation=activation, lora=True, seed=seed)
    inp = build_expert_inputs(case)
    parts = []
    for r, c in enumerate(counts):
        m = torch.full((c,), r % L, dtype=torch.int32)
        if c >= 3:
            m[1] = -1
        parts.append(m)
    mapping = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)
    return inp, mapping[:T]


def _reference(inp, mapping, counts, activation, dtype, E):
    ep = len(counts)
    cfg = _config(activation, dtype, E // ep)
    path = TritonExperts.lora_path(cfg, sum(counts), L)
    lora = LoRAInputs(inp.stacked, mapping)
    kw = dict(activation=activation, lora=lora, ep_size=ep, tokens_per_rank=list(counts))
    truth = sharded_experts_forward(inp.hidden, inp.w13, inp.w2, inp.topk_weights, inp.topk_ids,
                                    precision=make_precision("exact", None), **kw)
    emu = sharded_experts_forward(inp.hidden, inp.w13, inp.w2, inp.topk_weights, inp.topk_ids,
                                  precision=make_precision(path, DT[dtype]), **kw)
    return truth, emu


def _config(activation, dtype, E_local):
    return MoEConfig(device="cpu", dtype=DT[dtype], activation=activation, H=H, I=I, E=E_local, top_k=TOP_K,
                     lora_enabled=True, max_lora_rank=R, expert_map=True)


def _rank_layer(comm, inp, mapping, counts, activation, dtype, E, pf_cls=NaiveEPPrepareAndFinalize):
    """Rank comm.rank's forward over its own tokens; returns its (T_r, H) output."""
    r, ep = comm.rank, comm.size
    lo, hi = sum(counts[:r]), sum(counts[:r + 1])
    cfg = _config(activation, dtype, E // ep)
    pf = pf_cls(comm, E)
    assert torch.equal(pf.expert_map, ep_expert_map(E, ep, r))
    w13, w2, _ = ep_slice_base(inp.w13, inp.w2, ep_size=ep, ep_rank=r)
    st = inp.stacked
    a13, b13, a2, b2 = slice_lora_to_local(st.w13_a, st.w13_b, st.w2_a, st.w2_b, ep_rank=r, ep_size=ep)
    ref = ep_slice_lora(st, ep, r)
    assert all(torch.equal(x, y) for x, y in zip(a13 + b13 + a2 + b2, ref.w13_a + ref.w13_b + ref.w2_a + ref.w2_b))
    ctx = MoELoRAContext(w13_lora_a_stacked=a13, w13_lora_b_stacked=b13, w2_lora_a_stacked=a2,
                         w2_lora_b_stacked=b2, adapter_enabled=st.adapter_enabled.clone(), max_loras=L, top_k=TOP_K,
                         w13_num_slices=len(a13), local_num_experts=E // ep, token_lora_mapping=mapping[lo:hi].clone())
    kernel = FusedMoEKernel(pf, TritonExperts(cfg))
    return kernel.apply(inp.hidden[lo:hi].clone(), w13, w2, inp.topk_weights[lo:hi].clone(),
                        inp.topk_ids[lo:hi].clone(), lora_ctx=ctx, expert_map=pf.expert_map)


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


def _ep_run(counts, activation, dtype, E, pf_cls=NaiveEPPrepareAndFinalize):
    inp, mapping = _problem(counts, activation, dtype, E)
    truth, emu = _reference(inp, mapping, counts, activation, dtype, E)
    outs = _run_threads(SimulatedGroup(len(counts)),
                        lambda comm: _rank_layer(comm, inp, mapping, counts, activation, dtype, E, pf_cls))
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


# ----------------------------------------------------------------------------- planted bugs


class _OwnMappingBug(NaiveEPPrepareAndFinalize):
    """(a) the gathered batch gets this rank's own tokens' mapping (cycled), not the dispatched one."""

    def prepare(self, hidden_states, topk_weights, topk_ids, config, *, lora_ctx=None):
        out = super().prepare(hidden_states, topk_weights, topk_ids, config, lora_ctx=lora_ctx)
        own, Tg = lora_ctx.token_lora_mapping, int(out[1].shape[0])
        lora_ctx.local_token_lora_mapping = (own[torch.arange(Tg) % own.shape[0]] if own.shape[0]
                                             else torch.full((Tg,), -1, dtype=torch.int32)).contiguous()
        return out


class _SliceFromStartBug(NaiveEPPrepareAndFinalize):
    """(b) each source rank's chunk of the mapping sliced [:num_local_tokens] from the start of the gathered
    mapping instead of at its offset (right for rank 0's tokens only)."""

    def prepare(self, hidden_states, topk_weights, topk_ids, config, *, lora_ctx=None):
        out = super().prepare(hidden_states, topk_weights, topk_ids, config, lora_ctx=lora_ctx)
        g = lora_ctx.local_token_lora_mapping
        lora_ctx.local_token_lora_mapping = torch.cat([g[:n] for n in self.tokens_per_rank]).contiguous()
        return out


class _SumTwiceBug(NaiveEPPrepareAndFinalize):
    """(c) the combine all-reduces and then reduce-scatters the already-summed output (sums twice)."""

    def finalize(self, output, config):
        sizes = list(self.tokens_per_rank)
        mine = super().finalize(output, config)
        full = self.comm.all_gather([mine])[0]   # = all-reduce of the partials
        return self.comm.reduce_scatter(full, sizes)


@pytest.mark.parametrize("bug", [_OwnMappingBug, _SliceFromStartBug, _SumTwiceBug])
def test_planted_bug_fails(bug):
    vs = _ep_run([3, 4], "silu", "float32", 4, pf_cls=bug)
    assert not all(v.ok for v in vs), f"{bug.__name__} passed the comparison"
    if bug is _SliceFromStartBug:
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


def _one_rank_layer(comm, hidden, mapping, dtype=torch.float32, fully_sharded=False):
    """A single rank's prepare with deliberately wrong per-rank arguments (no collective is reached)."""
    cfg = _config("silu", "float32", 2)
    pf = NaiveEPPrepareAndFinalize(comm, 4)
    T = int(hidden.shape[0])
    ctx = MoELoRAContext(
        w13_lora_a_stacked=[torch.zeros(L, 2, R, H)] * 2, w13_lora_b_stacked=[torch.zeros(L, 2, I, R)] * 2,
        w2_lora_a_stacked=[torch.zeros(L, 2, R, I)], w2_lora_b_stacked=[torch.zeros(L, 2, H, R)],
        adapter_enabled=torch.ones(L + 1, dtype=torch.int32), max_loras=L, top_k=TOP_K, w13_num_slices=2,
        local_num_experts=2, token_lora_mapping=mapping)
    pf.prepare(hidden.to(dtype), torch.ones(T, TOP_K), torch.zeros(T, TOP_K, dtype=torch.int32), cfg, lora_ctx=ctx)


def test_per_rank_argument_errors():
    comm = SimulatedGroup(2, timeout_s=1).rank_communicator(1)
    m3 = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"hidden_states \(rank 1\) has hidden size 16"):
        _one_rank_layer(comm, torch.zeros(3, 16), m3)
    with pytest.raises(ValueError, match=r"token_lora_mapping \(rank 1\) has length 2; expected .* T=3"):
        _one_rank_layer(comm, torch.zeros(3, H), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"hidden_states \(rank 1\) has dtype torch.float16"):
        _one_rank_layer(comm, torch.zeros(3, H), m3, dtype=torch.float16)


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
    import torch.multiprocessing as mp
    os.environ.setdefault("TRITON_INTERPRET", "1")
    ctx = mp.start_processes(_gloo_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("gloo ranks did not finish within 120 s")
    inp, mapping = _problem(_GLOO["counts"], _GLOO["activation"], _GLOO["dtype"], _GLOO["E"])
    truth, emu = _reference(inp, mapping, _GLOO["counts"], _GLOO["activation"], _GLOO["dtype"], _GLOO["E"])
    outs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r, v in enumerate(_verdicts(outs, truth, emu, _GLOO["counts"], _GLOO["dtype"])):
        assert v.ok, f"rank {r}: {v.kind} {v.message}"
