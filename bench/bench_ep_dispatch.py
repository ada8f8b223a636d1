"""Benchmark (not a test) the cost of carrying the token -> LoRA mapping as an extra tensor in the EP dispatch.

`NaiveEPPrepareAndFinalize.dispatch` (kernels/experts/ep_prepare_finalize.py) makes one communicator
all-gather of [count (1,) int64, hidden_states (T, H) model dtype, topk_weights (T, k) fp32,
topk_ids (T, k) int32, *extras]; with LoRA the extras are the mapping (T,) int32. This script times that
dispatch without (`base`) and with (`lora`) the mapping, per model of bench/shapes.py (its H and top_k) and
tokens per rank T (the same T on every rank), and counts what each variant exchanges:

  payload_B     logical bytes per rank: 8 + T*H*dtype + T*k*4 + T*k*4 (+ T*4 with the mapping);
  coll_calls    collective calls per dispatch on this rank, counted by wrapping the communicator (not
                derived from a formula). TorchDistributedCommunicator.all_gather exchanges each tensor's
                first dim first (an int64 all_gather), then all-gathers the tensor padded to the largest
                rank: 2 calls per tensor, so 8 without and 10 with the mapping. SimulatedGroup makes one
                exchange per all_gather (1 and 1);
  coll_in_B     bytes this rank feeds into those calls (size exchanges and padding included; with equal T
                there is no padding); it receives (world - 1) times as much from the others.

Times: `warmup` untimed dispatches per variant, then up to `rep` timed repeats with the two variants
alternating (base, lora, base, ...), a barrier before each; a repeat is rank 0's wall time of one
dispatch call. Reported: median, p10, p90 (ms) and the overhead (lora / base - 1) of the medians. The
number of repeats is cut so that one case takes about --case-budget-s (never fewer than --min-rep).
Before timing, one dispatch per variant is checked: the gathered tensors equal every rank's inputs.

Backends:
  gloo       `world` processes (torch.multiprocessing spawn), init over tcp://127.0.0.1:<free port>,
             TorchDistributedCommunicator; CPU tensors; bf16 when gloo's all_gather takes it (probed
             at start), else fp16; the dtype used is in the output.
  nccl       the same with one GPU per rank (needs torch.cuda.device_count() >= world, else exits 2
             saying how many it needs); times are CUDA-event times of the dispatch (and the host wall
             time beside them), the device synchronized before and after. NCCL's environment is left as
             the machine sets it. bf16.
  simulated  SimulatedGroup (threads of one process taking turns); bytes, calls and the in-process time
             only: no network is involved, the time is thread hand-offs and copies, not a network cost.

  python bench/bench_ep_dispatch.py --backend gloo --world 2 --out DIR [--models qwen3moe,mixtral]
      [--T 1,16,128,1024,4096] [--warmup 3] [--rep 30] [--min-rep 5] [--case-budget-s 6]

Writes DIR/ep_dispatch.json (meta: machine, torch, backend, world, dtype; one row per case and variant)
and DIR/ep_dispatch.md (one row per case: bytes, calls, medians, overheads).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import socket
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from bench_experts import markdown_table  # noqa: E402  (one table writer for the bench scripts)
from shapes import MODELS, T_ALL  # noqa: E402

BACKENDS = ("gloo", "nccl", "simulated")
VARIANTS = ("base", "lora")
N_LORAS = 4  # the mapping's values (slot ids); only its size matters to the dispatch


# ----------------------------------------------------------------------------- helpers


def quantile(xs: list[float], q: float) -> float:
    """Linear-interpolation quantile of xs (q in [0, 1])."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def source_meta() -> dict:
    """The commit, and whether the two files the benchmark exercises differ from it in the working tree."""
    import subprocess

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    files = ["kernels/experts/ep_prepare_finalize.py", "harness/execution/communicator.py"]
    return dict(commit=git("rev-parse", "HEAD"),
                uncommitted_changes={f: bool(git("status", "--porcelain", "--", f)) for f in files})


def machine_meta() -> dict:
    meta = dict(cpu_model=cpu_model(), cpu_count=os.cpu_count(), python=platform.python_version(),
                platform=platform.platform(), torch=torch.__version__)
    try:
        meta["cpus_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    return meta


def make_inputs(model: str, T: int, rank: int, dtype: torch.dtype, device) -> dict:
    """Rank `rank`'s dispatch inputs for (model, T), seeded by (T, rank) so any rank can rebuild them."""
    H, _I, E, k = MODELS[model]
    g = torch.Generator().manual_seed(1_000_003 * T + rank)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k].to(torch.int32).contiguous()
    weights = torch.softmax(torch.rand(T, k, generator=g), dim=-1).float()
    mapping = torch.randint(0, N_LORAS, (T,), generator=g, dtype=torch.int32)
    return {n: t.to(device) for n, t in dict(hidden=hidden, weights=weights, ids=ids, mapping=mapping).items()}


def payload_bytes(inp: dict, variant: str) -> int:
    """Logical bytes of one rank's dispatch: the int64 count + hidden + weights + ids (+ mapping)."""
    n = 8 + sum(inp[k].numel() * inp[k].element_size() for k in ("hidden", "weights", "ids"))
    if variant == "lora":
        n += inp["mapping"].numel() * inp["mapping"].element_size()
    return n


class _CountingDist:
    """Stands in for torch.distributed inside a TorchDistributedCommunicator: counts collective calls and the
    bytes this rank feeds them, forwarding everything."""

    COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "reduce_scatter", "broadcast")

    def __init__(self, dist):
        self._real = dist
        self.calls = 0
        self.bytes_in = 0

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name not in self.COLLECTIVES:
            return attr

        def counted(*args, **kwargs):
            t = args[1] if name in ("all_gather", "all_gather_into_tensor") else args[0]
            self.calls += 1
            self.bytes_in += t.numel() * t.element_size()
            return attr(*args, **kwargs)
        return counted


class _CountingGroup:
    """Stands in for a SimulatedGroup inside one rank's SimulatedCommunicator: counts that rank's exchanges
    (one per all_gather) and the tensor bytes it deposits, forwarding everything."""

    def __init__(self, group):
        self._real = group
        self.calls = 0
        self.bytes_in = 0

    def __getattr__(self, name):
        return getattr(self._real, name)

    def exchange(self, rank, name, value):
        self.calls += 1
        ts = value if isinstance(value, (list, tuple)) else [value]
        self.bytes_in += sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))
        return self._real.exchange(rank, name, value)


def count_collectives(comm, fn) -> tuple[object, dict]:
    """(fn(), {calls, bytes}): the collective calls this rank made in fn and the bytes it fed them."""
    from moe_lora_harness.harness.execution.communicator import SimulatedCommunicator

    if isinstance(comm, SimulatedCommunicator):
        attr, proxy = "group", _CountingGroup(comm.group)
    else:
        attr, proxy = "_dist", _CountingDist(comm._dist)
    real = getattr(comm, attr)
    setattr(comm, attr, proxy)   # this rank's communicator object only
    try:
        out = fn()
    finally:
        setattr(comm, attr, real)
    return out, {"calls": proxy.calls, "bytes": proxy.bytes_in}


def check_gathered(model, T, world, dtype, got, variant) -> str | None:
    """None when the dispatch returned every rank's inputs in rank order, else what differs."""
    x, w, ids, extras, sizes = got
    if sizes != [T] * world:
        return f"sizes {sizes} != {[T] * world}"
    ref = [make_inputs(model, T, r, dtype, "cpu") for r in range(world)]
    want = dict(hidden=x, weights=w, ids=ids)
    if variant == "lora":
        if len(extras) != 1:
            return f"{len(extras)} extras back, expected 1"
        want["mapping"] = extras[0]
    elif extras:
        return f"{len(extras)} extras back, expected 0"
    for name, t in want.items():
        exp = torch.cat([r[name] for r in ref], dim=0)
        if t.dtype != exp.dtype or not torch.equal(t.cpu(), exp):
            return f"gathered {name} differs from the ranks' inputs"
    return None


# ----------------------------------------------------------------------------- one rank's sweep


class Clock:
    """Times one dispatch on this rank: host wall time, and CUDA-event time on a GPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def time(self, fn) -> tuple[float, float | None]:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) * 1e3, start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3, None


def sweep(comm, barrier, agree_int, device, dtype, cfg: dict) -> list[dict]:
    """Every (model, T) case on this rank; rows are meaningful on rank 0 (its times)."""
    from moe_lora_harness.kernels.experts.ep_prepare_finalize import NaiveEPPrepareAndFinalize

    rank, world = comm.rank, comm.size
    clock = Clock(device)
    rows = []
    for model in cfg["models"]:
        H, _I, E, k = MODELS[model]
        pf = NaiveEPPrepareAndFinalize(comm, E)
        for T in cfg["Ts"]:
            inp = make_inputs(model, T, rank, dtype, device)
            args = {v: (inp["hidden"], inp["weights"], inp["ids"], [inp["mapping"]] if v == "lora" else [])
                    for v in VARIANTS}
            case = dict(model=model, H=H, top_k=k, T=T, world=world)
            per_variant = {}
            for v in VARIANTS:  # one counted, checked dispatch per variant (untimed)
                barrier()
                got, stats = count_collectives(comm, lambda: pf.dispatch(*args[v][:3], args[v][3]))
                err = check_gathered(model, T, world, dtype, got, v) if rank == 0 else None
                per_variant[v] = dict(case, variant=v, payload_B=payload_bytes(inp, v), coll_calls=stats["calls"],
                                      coll_in_B=stats["bytes"], check=err or "ok")
                del got
            t_warm = time.perf_counter()
            for _ in range(cfg["warmup"]):
                for v in VARIANTS:
                    barrier()
                    pf.dispatch(*args[v][:3], args[v][3])
            warm_s = (time.perf_counter() - t_warm) / max(cfg["warmup"], 1)  # one base + one lora dispatch
            # rank 0 picks the repeat count from its warmup time; every rank must run the same number
            reps = max(cfg["min_rep"], min(cfg["rep"], int(cfg["case_budget_s"] / max(warm_s, 1e-9))))
            reps = agree_int(reps)
            wall = {v: [] for v in VARIANTS}
            event = {v: [] for v in VARIANTS}
            for _ in range(reps):
                for v in VARIANTS:
                    barrier()
                    w_ms, e_ms = clock.time(lambda: pf.dispatch(*args[v][:3], args[v][3]))
                    wall[v].append(w_ms)
                    if e_ms is not None:
                        event[v].append(e_ms)
            for v in VARIANTS:
                r = per_variant[v]
                times = event[v] if event[v] else wall[v]
                r.update(reps=reps, timer="cuda_event" if event[v] else "wall",
                         ms_median=quantile(times, 0.5), ms_p10=quantile(times, 0.1), ms_p90=quantile(times, 0.9),
                         ms_all=[round(t, 5) for t in times])
                if event[v]:
                    r.update(wall_ms_median=quantile(wall[v], 0.5))
                rows.append(r)
            if rank == 0:
                b, lo = per_variant["base"], per_variant["lora"]
                print(json.dumps(dict(model=model, T=T, world=world, reps=reps, base_ms=round(b["ms_median"], 4),
                                      lora_ms=round(lo["ms_median"], 4), calls=(b["coll_calls"], lo["coll_calls"]),
                                      check=(b["check"], lo["check"]))), flush=True)
    return rows


# ----------------------------------------------------------------------------- backends


def _dist_worker(rank: int, world: int, backend: str, port: int, cfg: dict, result_path: str) -> None:
    import torch.distributed as dist

    from moe_lora_harness.harness.execution.communicator import TorchDistributedCommunicator

    torch.set_num_threads(cfg["threads"])
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        dtype, dtype_note = torch.bfloat16, "bf16"
        if backend == "gloo":  # probe: does gloo's all_gather take bf16?
            probe = torch.ones(2, 3, dtype=torch.bfloat16)
            ok = torch.ones(1, dtype=torch.int32)
            try:
                parts = [torch.empty_like(probe) for _ in range(world)]
                dist.all_gather(parts, probe)
                ok &= torch.tensor([int(all(torch.equal(p, probe) for p in parts))], dtype=torch.int32)
            except (RuntimeError, ValueError):
                ok.zero_()
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if not int(ok):
                dtype, dtype_note = torch.float16, "fp16 (gloo all_gather rejected bf16)"

        comm = TorchDistributedCommunicator()

        def barrier():
            if backend == "nccl":
                dist.barrier(device_ids=[rank])
            else:
                dist.barrier()

        def agree_int(n: int) -> int:
            t = torch.tensor([n], dtype=torch.int64, device=device)
            dist.broadcast(t, src=0)
            return int(t.item())

        rows = sweep(comm, barrier, agree_int, device, dtype, cfg)
        if rank == 0:
            extra = {}
            if backend == "nccl":
                extra = dict(gpus=[torch.cuda.get_device_name(i) for i in range(world)],
                             cuda=torch.version.cuda, nccl=str(torch.cuda.nccl.version()))
            pathlib.Path(result_path).write_text(json.dumps(dict(rows=rows, dtype=dtype_note, **extra)))
        barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(backend: str, world: int, cfg: dict) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "rank0.json")
        mp.spawn(_dist_worker, args=(world, backend, free_port(), cfg, result_path), nprocs=world, join=True)
        return json.loads(pathlib.Path(result_path).read_text())


def run_simulated(world: int, cfg: dict) -> dict:
    from moe_lora_harness.harness.execution.communicator import SimulatedGroup

    torch.set_num_threads(cfg["threads"])
    group = SimulatedGroup(world, timeout_s=600.0)

    def fn(comm):
        def barrier():
            group.exchange(comm.rank, "barrier", None)

        def agree_int(n: int) -> int:
            return int(group.exchange(comm.rank, "agree", n)[0])

        return sweep(comm, barrier, agree_int, torch.device("cpu"), torch.bfloat16, cfg)

    results = group.run(fn, join_timeout_s=3600.0)
    return dict(rows=results[0], dtype="bf16")


# ----------------------------------------------------------------------------- output


def summary_rows(rows: list[dict]) -> list[dict]:
    """One row per (model, T): bytes, calls, medians and overheads of lora over base."""
    out = []
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["T"]), {})[r["variant"]] = r
    for (model, T), d in by.items():
        b, lo = d["base"], d["lora"]
        out.append(dict(
            model=model, H=b["H"], k=b["top_k"], T=T, payload_B=b["payload_B"], payload_lora_B=lo["payload_B"],
            bytes_overhead=f"{100 * (lo['payload_B'] / b['payload_B'] - 1):.3f}%",
            calls=f"{b['coll_calls']} -> {lo['coll_calls']}",
            base_ms=f"{b['ms_median']:.4g} [{b['ms_p10']:.4g}, {b['ms_p90']:.4g}]",
            lora_ms=f"{lo['ms_median']:.4g} [{lo['ms_p10']:.4g}, {lo['ms_p90']:.4g}]",
            time_overhead=f"{100 * (lo['ms_median'] / b['ms_median'] - 1):+.1f}%",
            paired_delta_ms=quantile([y - x for x, y in zip(b["ms_all"], lo["ms_all"])], 0.5),
            coll_in_B=f"{b['coll_in_B']} -> {lo['coll_in_B']}",
            reps=b["reps"], check="ok" if b["check"] == lo["check"] == "ok" else f"{b['check']}; {lo['check']}"))
    return out


SUMMARY_COLUMNS = ["model", "H", "k", "T", "payload_B", "payload_lora_B", "bytes_overhead", "calls", "coll_in_B",
                   "base_ms", "lora_ms", "time_overhead", "paired_delta_ms", "reps", "check"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS, default="gloo")
    p.add_argument("--world", type=int, default=2, help="ranks (processes, GPUs or threads)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--T", default=",".join(map(str, T_ALL)), help="comma-separated tokens per rank")
    p.add_argument("--warmup", type=int, default=3, help="untimed dispatches per variant per case")
    p.add_argument("--rep", type=int, default=30, help="most timed repeats per variant per case")
    p.add_argument("--min-rep", type=int, default=5, help="fewest timed repeats per variant per case")
    p.add_argument("--case-budget-s", type=float, default=6.0,
                   help="cut the repeats of a case to about this many seconds (never below --min-rep)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--out", required=True, help="output folder (ep_dispatch.json, ep_dispatch.md)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.world < 1:
        raise SystemExit("--world must be >= 1")
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; known {sorted(MODELS)}")
    for m in models:
        if MODELS[m][2] % args.world:
            raise SystemExit(f"--world {args.world} does not divide {m}'s {MODELS[m][2]} experts (EP needs it)")
    Ts = [int(t) for t in args.T.split(",") if t]
    if args.backend == "nccl":
        import torch.distributed as dist
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < args.world:
            print(f"bench_ep_dispatch --backend nccl --world {args.world} needs {args.world} CUDA GPUs (one per "
                  f"rank); this machine has {have}", file=sys.stderr)
            return 2
        if not dist.is_nccl_available():
            print("bench_ep_dispatch --backend nccl: this torch build has no NCCL", file=sys.stderr)
            return 2
    cfg = dict(models=models, Ts=Ts, warmup=args.warmup, rep=args.rep, min_rep=args.min_rep,
               case_budget_s=args.case_budget_s, threads=args.threads)
    start = time.time()
    load_before = os.getloadavg()
    if args.backend == "simulated":
        res = run_simulated(args.world, cfg)
    else:
        res = run_distributed(args.backend, args.world, cfg)
    rows = res.pop("rows")
    meta = dict(machine_meta(), **source_meta(), backend=args.backend, world=args.world, dtype=res.pop("dtype"),
                threads_per_rank=args.threads, warmup=args.warmup, rep=args.rep, min_rep=args.min_rep,
                case_budget_s=args.case_budget_s, seconds=round(time.time() - start, 1),
                loadavg_1_5_15_before=[round(v, 2) for v in load_before],
                loadavg_1_5_15_after=[round(v, 2) for v in os.getloadavg()], **res)
    meta["time_is"] = {
        "gloo": "rank 0 wall time of one dispatch call (gloo over TCP loopback; all ranks on this host)",
        "nccl": "rank 0 CUDA-event time of one dispatch call (device synchronized before and after)",
        "simulated": "rank 0 in-process time of one dispatch (threads taking turns): NOT a network cost",
    }[args.backend]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = summary_rows(rows)
    (out / "ep_dispatch.json").write_text(json.dumps(dict(meta=meta, summary=summary, rows=rows), indent=1))
    label = {"gloo": "gloo", "nccl": "NCCL", "simulated": "SimulatedGroup (in-process, not a network cost)"}
    text = (f"# EP dispatch: the token->LoRA mapping as an extra tensor ({label[args.backend]}, world "
            f"{args.world}, {meta['dtype']})\n\n"
            f"Machine: {meta['cpu_model']}, {meta['cpu_count']} cores, torch {meta['torch']}"
            + (f", GPUs {meta['gpus']}" if "gpus" in meta else "") + ".\n"
            f"Times (ms): median [p10, p90], {meta['time_is']}. payload_B: logical bytes per rank "
            f"(count + hidden + topk weights + topk ids, + mapping); calls: collective calls per dispatch "
            f"without -> with the mapping; coll_in_B: bytes this rank feeds those calls (size exchanges and padding "
            f"included), without -> with; time_overhead: lora median / base median - 1; paired_delta_ms: median "
            f"over the repeats of (lora - base), the two variants alternating with a barrier before each.\n\n")
    text += markdown_table(summary, SUMMARY_COLUMNS)
    (out / "ep_dispatch.md").write_text(text)
    failed = [r for r in rows if r["check"] != "ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
