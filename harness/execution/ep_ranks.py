"""Dispatched expert parallelism: every EP rank of a case run through a backend, each with its own tokens.

Two drivers, the same cases: ranks as turn-taking threads of this process over a `SimulatedGroup`
(`ep_comm="simulated"`: fast, any device), or as real processes over torch.distributed
(`ep_comm="processes"`: gloo on the CPU, NCCL with one GPU per rank), each loading the backend from its
reference. A rank's `ExpertCall` (`rank_call`) holds its own tokens, its local base experts, the global LoRA
factors and a Communicator; the ranks' (T_r, H) outputs, concatenated in rank order, are the case's (T, H)
output, which the judge compares with the float64 reference of the whole batch.

One rank process is harness.execution.fork_server.start("moe_lora_harness.harness.execution.ep_ranks:_rank_main",
(RANK, WORLD, PORT, DIR)), started by run_processes.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import time

import torch

from moe_lora_harness.harness.execution import fork_server
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.contract import BackendSpec, ExpertCall
from moe_lora_harness.harness.build.guards import guard_calls, written_outside
from moe_lora_harness.harness.execution.execute import (ExecutionFailure, Failure, InputWatch, harness_built,
                                                       inputs_digest, raised_text)
from moe_lora_harness.harness.execution.interpreter import LaunchWatch

COLLECTIVE_TIMEOUT_S = 60.0    # a rank that skips a collective makes the others raise after this long
TIMEOUT_ENV = "MOE_LORA_HARNESS_EP_TIMEOUT"   # seconds; overrides COLLECTIVE_TIMEOUT_S (rank processes inherit it)
PROCESS_START_S = 120.0        # a rank process's import, rendezvous and first call, on top of the timeout


def collective_timeout() -> float:
    """Seconds a rank waits in a collective for the others ($MOE_LORA_HARNESS_EP_TIMEOUT, default 60)."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    if not raw:
        return COLLECTIVE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds; got {raw!r}")
    return value


def token_range(case: Case, rank: int) -> tuple[int, int]:
    """[lo, hi) of rank's tokens in the concatenated batch."""
    lo = sum(case.ep_tokens[:rank])
    return lo, lo + case.ep_tokens[rank]


def rank_call(built, case: Case, rank: int, device, comm) -> ExpertCall:
    """EP rank `rank`'s ExpertCall of a dispatched case (see ExpertCall's EP fields); output NaN-poisoned."""
    lo, hi = token_range(case, rank)
    n = case.E // case.ep_size
    elo, ehi = rank * n, (rank + 1) * n
    mv = lambda t: None if t is None else t.to(device)  # noqa: E731
    tok = lambda t: None if t is None else t[lo:hi].to(device)  # noqa: E731
    exp = lambda t: None if t is None else t[elo:ehi].to(device)  # noqa: E731
    lst = lambda ts: None if ts is None else [t.to(device) for t in ts]  # noqa: E731
    s = built.stacked
    quantized = {}
    if built.quantized:
        quantized = dict(zip(("w13_q", "w13_scales", "w2_q", "w2_scales"), [exp(t) for t in built.quantized]))
    return ExpertCall(
        output=torch.full((hi - lo, case.H), float("nan"), dtype=built.hidden.dtype, device=device),
        hidden_states=tok(built.hidden), w13=exp(built.w13), w2=exp(built.w2),
        topk_weights=tok(built.topk_weights), topk_ids=tok(built.topk_ids), activation=case.activation,
        w13_bias=exp(built.w13_bias), w2_bias=exp(built.w2_bias),
        w13_lora_a=lst(s.w13_a) if s else None, w13_lora_b=lst(s.w13_b) if s else None,
        w2_lora_a=lst(s.w2_a) if s else None, w2_lora_b=lst(s.w2_b) if s else None,
        adapter_enabled=mv(s.adapter_enabled) if s else None, token_lora_mapping=tok(built.token_lora_mapping),
        max_loras=case.max_loras, apply_router_weight_on_input=case.apply_router_weight_on_input,
        quant=case.quant, **quantized, fully_sharded=case.fully_sharded and case.lora,
        ep_comm=comm, ep_rank=rank, ep_size=case.ep_size, num_experts_global=case.E)


def driver_problem(case: Case, device: str) -> str:
    """Why this machine cannot run the case's EP driver ("" when it can)."""
    if not case.dispatched or case.ep_comm == "simulated":
        return ""
    import torch.distributed as dist
    if not dist.is_available():
        return "torch.distributed is not available in this torch build (EP over processes)"
    if str(device).startswith("cuda"):
        have = torch.cuda.device_count()
        if have < case.ep_size:
            return f"EP over NCCL processes needs one GPU per rank: {case.ep_size} ranks, {have} GPU(s) here"
        if not dist.is_nccl_available():
            return "NCCL is not available in this torch build"
    elif not dist.is_gloo_available():
        return "gloo is not available in this torch build (EP over CPU processes)"
    return ""


# ----------------------------------------------------------------------------- simulated ranks


def run_simulated(spec: BackendSpec, built, case: Case, device: str, watch: InputWatch | None = None,
                  bands: list | None = None) -> torch.Tensor:
    """Every rank's call on a SimulatedGroup (threads taking turns); their outputs concatenated. With `bands` (a
    list), each rank's tensors are handed over between guard bands, kept there to be read after the call."""
    from moe_lora_harness.harness.execution.communicator import SimulatedGroup
    group = SimulatedGroup(case.ep_size, timeout_s=collective_timeout())
    calls = [rank_call(built, case, r, device, group.rank_communicator(r)) for r in range(case.ep_size)]
    if bands is not None:
        calls, guarded = guard_calls(calls, [f"rank{r}." for r in range(case.ep_size)])
        bands.extend(guarded)
    if watch is not None:
        for r, call in enumerate(calls):
            watch.add(f"rank{r}", call)
    group.run(lambda comm: spec.experts(calls[comm.rank]))
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    return torch.cat([c.output for c in calls], dim=0)


# ----------------------------------------------------------------------------- real processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-lines:])
    except OSError:
        return ""


def run_processes(spec: BackendSpec, case: Case, device: str, digest: str,
                  timeout_s: float | None = None) -> tuple[torch.Tensor, list, str, list, list]:
    """Every rank as a process of its own over torch.distributed; (output, inputs written, digest seen, the ranks'
    interpreted launches, writes into their guard bands: each rank guards its own call).

    The backend is loaded in each rank from `spec.origin`. A rank that raises, dies or hangs becomes an
    ExecutionFailure naming it (the earliest failure is the root cause; the other ranks are then stopped).
    `digest` is what the ranks' inputs must hash to; a rank that built other inputs is reported back.
    """
    from moe_lora_harness.harness.execution.worker import _describe_exit, child_env
    if not spec.origin:
        raise ValueError(f"backend {spec.name!r} has no origin: EP over processes loads the backend in every "
                         f"rank by reference (load it with harness.spec.registry)")
    world = case.ep_size
    timeout_s = timeout_s if timeout_s is not None else 2 * collective_timeout() + PROCESS_START_S
    with tempfile.TemporaryDirectory(prefix="moe-lora-ep-") as tmp:
        job = dict(origin=spec.origin, name=spec.name, case=case.to_json(), device=str(device),
                   setup=spec.setup if isinstance(spec.setup, str) else None)
        with open(os.path.join(tmp, "job.json"), "w") as f:
            json.dump(job, f)
        port = _free_port()
        procs, env = [], child_env()
        for r in range(world):   # forked by the fork server: no Python start, no torch import per rank
            with open(os.path.join(tmp, f"rank{r}.log"), "wb") as log:
                procs.append(fork_server.start("moe_lora_harness.harness.execution.ep_ranks:_rank_main", (r, world, port, tmp),
                                               env=env, output=log.fileno()))
        deadline = time.monotonic() + timeout_s
        dead = None
        while any(p.poll() is None for p in procs):
            for r, p in enumerate(procs):
                code = p.poll()
                if code not in (None, 0) and not os.path.exists(os.path.join(tmp, f"rank{r}.pt")):
                    dead = dead or (r, code)
                if os.path.exists(os.path.join(tmp, f"rank{r}.failed")):
                    # a rank raised: the others may wait in a collective it never joins; give them a
                    # moment to finish (or raise too), then stop them: the first failure is the verdict
                    deadline = min(deadline, time.monotonic() + 5.0)
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        # a rank that died (not killed by us) is the root cause, even if a peer wrote its connection error first
        died = [(r, p.returncode) for r, p in enumerate(procs) if r not in hung and p.returncode != 0
                and not os.path.exists(os.path.join(tmp, f"rank{r}.pt"))]
        dead = dead or (died[0] if died else None)
        results = {}
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.pt")
            if os.path.exists(path):
                results[r] = torch.load(path, weights_only=False)
        logs = "\n".join(f"[rank {r}] " + _tail(os.path.join(tmp, f"rank{r}.log")).replace("\n", f"\n[rank {r}] ")
                         for r in range(world))
        if dead is not None:
            r, code = dead
            why = _describe_exit(code)
            raise ExecutionFailure(Failure("crash", f"EP rank {r}'s process {why} during the call",
                                           exc_type=why.split()[-1], traceback=logs))
        failed = sorted((res["failure"] for res in results.values() if res.get("failure")), key=lambda f: f["time"])
        if failed:
            f = failed[0]
            return_msg = f"{f['message']} [raised on EP rank {f['rank']} of {world}]"
            raise ExecutionFailure(Failure(f["kind"], return_msg[:4000], f["exc_type"], f["traceback"]))
        if hung or len(results) < world:
            missing = hung or [r for r in range(world) if r not in results]
            raise ExecutionFailure(Failure("timeout", f"EP rank(s) {missing} did not finish within {timeout_s:g}s "
                                                      f"(over processes; the ranks were killed)", fatal=False,
                                           traceback=logs))
        seen = digest
        for r in range(world):
            if results[r]["digest"] != digest:
                seen = results[r]["digest"]
        written = [w for r in range(world) for w in results[r]["written"]]
        outside = [w for r in range(world) for w in results[r]["outside"]]
        launches = [x for r in range(world) for x in results[r].get("launches", [])]
        return torch.cat([results[r]["output"] for r in range(world)], dim=0), written, seen, launches, outside


def _rank_main(rank: int, world: int, port: int, tmp: str) -> None:
    """One rank process: join the group, build the case's inputs, run this rank's call, save the result."""
    import faulthandler
    import traceback
    faulthandler.enable()
    with open(os.path.join(tmp, "job.json")) as f:
        job = json.load(f)
    import torch.distributed as dist
    from moe_lora_harness.harness.build.builders import build_expert_inputs, draw_device
    from moe_lora_harness.harness.execution.communicator import TorchDistributedCommunicator
    from moe_lora_harness.harness.spec.registry import load_ref
    device = job["device"]
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    result: dict = {"rank": rank, "failure": None, "written": [], "outside": [], "digest": "", "output": None}
    joined = False
    try:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective_timeout()))
        joined = True
        case = Case.from_json(job["case"])
        specs = {s.name: s for s in load_ref(job["origin"])}
        if job["name"] not in specs:
            raise LookupError(f"{job['origin']} provides no backend named {job['name']!r}")
        spec = specs[job["name"]]
        if job.get("setup") and spec.setup is None:
            import dataclasses
            spec = dataclasses.replace(spec, setup=job["setup"])
        from moe_lora_harness.harness.execution.execute import run_setup
        setup_failure = run_setup(spec)
        if setup_failure is not None:
            raise RuntimeError(setup_failure.message)
        built = harness_built(lambda: build_expert_inputs(case, draw_device(case, device)))  # as the judge draws
        result["digest"] = inputs_digest(built)
        call = rank_call(built, case, rank, device, TorchDistributedCommunicator())
        (call,), bands = guard_calls([call], [f"rank{rank}."])     # this rank's tensors: its own decision
        watch = InputWatch()
        watch.add(f"rank{rank}", call)
        with LaunchWatch() as launches:
            spec.experts(call)
        result["launches"] = launches.launches
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        result["written"] = watch.written()
        result["outside"] = written_outside(bands)
        result["output"] = call.output.detach().cpu().clone()
    except BaseException as e:  # noqa: BLE001 - the backend's failure is this rank's result
        kind = e.failure.kind if isinstance(e, ExecutionFailure) else "raised"   # the harness's drawing: its own
        result["failure"] = dict(rank=rank, time=time.time(), kind=kind, exc_type=type(e).__name__,
                                 message=raised_text(e), traceback="".join(traceback.format_exception(e)[-6:])[-6000:])
        open(os.path.join(tmp, f"rank{rank}.failed"), "w").close()
    path = os.path.join(tmp, f"rank{rank}.pt")
    torch.save(result, path + ".tmp")
    os.replace(path + ".tmp", path)
    if joined and result["failure"] is None:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the result is saved; teardown errors do not change it
            pass
