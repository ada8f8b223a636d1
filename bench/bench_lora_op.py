"""Benchmark our Triton MoE-LoRA paths on a GPU beside vLLM 0.33.0's figures (anchors), same method.

Shapes: qwen3moe / mixtral / gptoss20b, T in 1..4096, R 16 and 64, 4 LoRA slots, bf16, which = w13
(x (T,H), 2 slices, N = I) or w2 (x (T*k, I), 1 slice, N = H, mul_routed_weight). one_shot and
two_kernel run on the sorted layout (align block 64, aligned outside the timed region); small_batch
on the naive layout where it qualifies; `dispatch` is `fused_moe_lora` on the layout vLLM would pick
(naive when T*k*8 <= E*L). Times: triton.testing.do_bench medians, eager and as CUDA-graph replays
of 10 calls / 10. floor_ms: bytes that must move over the measured device copy bandwidth; at T >= 1024 also a
"gathered floor": the same with the output's read + write timed as a pure RMW of the op's gathered rows.
Eager calls run with MOE_LORA_UNCHECKED=1 (no id-range sync) unless --checked.
Each case is VERIFIED first: every path against the float64 reference's emulation of its rounding.

  python bench/bench_lora_op.py --out bench.json --md bench.md [--quick] [--models qwen3moe] [--T 1,16]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from moe_lora_harness.op_contract.validate import default_tuning  # noqa: E402
from shapes import MODELS, T_ALL  # noqa: E402
R_ALL = (16, 64)
NUM_LORAS = 4
ALIGN_BLOCK = 64
ANCHOR_DEFAULT = ROOT.parent / "shared" / "anchors" / "vllm-0.33.0-fused_moe_lora-h200.json"
TUNING = tuple(default_tuning(ALIGN_BLOCK).values())  # vLLM's default config ints, positionally


def build_case(model: str, which: str, T: int, R: int, seed: int = 0) -> dict:
    """Random bf16 inputs for one benchmark shape (both layouts), built on the GPU."""
    from moe_lora_harness.kernels.triton.align import moe_lora_align_block_size

    H, I, E, k = MODELS[model]
    S, K, N, mul = (2, H, I, False) if which == "w13" else (1, I, H, True)
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed)
    L = NUM_LORAS
    x = torch.randn(T * k if mul else T, K, device=dev, dtype=dt, generator=g)
    A = [(torch.randn(L, E, R, K, device=dev, dtype=dt, generator=g) / math.sqrt(K)) for _ in range(S)]
    B = [(torch.randn(L, E, N, R, device=dev, dtype=dt, generator=g) / math.sqrt(R)) for _ in range(S)]
    topk = torch.rand(T, E, device=dev, generator=g).argsort(dim=1)[:, :k].to(torch.int32).contiguous()
    weights = torch.softmax(torch.rand(T, k, device=dev, generator=g), dim=-1).float()
    mapping = torch.randint(0, L, (T,), device=dev, generator=g, dtype=torch.int32)
    enabled = torch.ones(L + 1, dtype=torch.int32, device=dev)
    uniq = torch.unique(mapping, sorted=True).to(torch.int32)
    lora_ids = torch.full((L + 1,), -1, dtype=torch.int32, device=dev)
    lora_ids[: uniq.numel()] = uniq
    nact = torch.tensor([L + 1], dtype=torch.int32)
    P = T * k
    M = P + E * (ALIGN_BLOCK - 1) if P >= E else P * ALIGN_BLOCK
    MB = -(-M // ALIGN_BLOCK)
    sids = torch.empty(L, M, dtype=torch.int32, device=dev)
    eids = torch.full((L, MB), -1, dtype=torch.int32, device=dev)
    ntpp = torch.empty(L, dtype=torch.int32, device=dev)
    moe_lora_align_block_size(topk, mapping, E, ALIGN_BLOCK, L, M, MB, sids, eids, ntpp, enabled, lora_ids)
    out = (torch.randn(T, k, S * N, device=dev, dtype=dt, generator=g) * 0.1)
    distinct = int(torch.unique(mapping.long()[:, None] * E + topk.long()).numel())
    return dict(model=model, which=which, T=T, R=R, k=k, E=E, S=S, K=K, N=N, mul=mul, out=out, x=x, A=A, B=B,
                weights=weights, topk=topk, mapping=mapping, enabled=enabled, lora_ids=lora_ids, nact=nact,
                sorted=(sids, eids, ntpp), naive=(None, topk.reshape(-1).contiguous(), None), distinct=distinct,
                naive_is_default=T * k * 8 <= E * L)


def op_args(c: dict, layout: str, out: torch.Tensor) -> tuple[tuple, dict]:
    """Positional args (vLLM signature) and keyword flags for one call on `out`."""
    sids, eids, ntpp = c[layout]
    args = (out, c["x"], c["A"], c["B"], c["weights"], sids, eids, ntpp, c["mapping"], c["R"], c["k"],
            c["lora_ids"], c["nact"], c["enabled"], *TUNING)
    return args, dict(mul_routed_weight=c["mul"])


def op_call(c: dict, layout: str, out: torch.Tensor):
    """The validated OpCall of one case on `out` (for driving a path's launcher with an explicit config)."""
    from moe_lora_harness.op_contract.validate import validate_call

    args, kw = op_args(c, layout, out)
    return validate_call(*args, fully_sharded=False, add_inputs=True, offset=0, **kw)


def floor_bytes(c: dict) -> int:
    """Bytes that must move: distinct (LoRA, expert) A and B once, x once, output read + written once."""
    esz = 2
    ab = c["distinct"] * c["S"] * (c["R"] * c["K"] + c["N"] * c["R"]) * esz
    return ab + c["x"].numel() * esz + 2 * c["out"].numel() * esz


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), measured with do_bench."""
    import triton

    src = torch.empty(1 << 29, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    del src, dst
    return 2 * (1 << 29) / (ms * 1e-3)


def rmw_floor_ms(c: dict, warmup: int, rep: int) -> tuple[float, dict]:
    """Best graph-replay ms of a pure read-modify-write of the rows the op touches, in the sorted layout
    (out[pair, :] += 1 for every pair of an active LoRA), over a few tilings: what the access pattern
    of gathered output rows alone costs, without the shrink, the B loads or the dot."""
    import triton
    import triton.language as tl

    @triton.jit
    def _rmw(out_ptr, sorted_ptr, ntpp_ptr, em, num_pairs, ncols, stride_om, stride_sl,
             SUB_M: tl.constexpr, BLOCK_N: tl.constexpr, N_PER: tl.constexpr):
        m_id = tl.program_id(0)
        lora = tl.program_id(1)
        pos = m_id * SUB_M + tl.arange(0, SUB_M)
        tok = tl.load(sorted_ptr + lora * stride_sl + pos, mask=pos < tl.load(ntpp_ptr + lora), other=num_pairs)
        tmask = tok < num_pairs
        rows = out_ptr + tl.where(tmask, tok, 0).to(tl.int64)[:, None] * stride_om
        n_lo = tl.program_id(2) * N_PER
        for n0 in range(n_lo, tl.minimum(n_lo + N_PER, ncols), BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            m = tmask[:, None] & (cols < ncols)[None, :]
            v = tl.load(rows + cols[None, :], mask=m, other=0.0)
            tl.store(rows + cols[None, :], v + 1.0, mask=m)

    sids, _, ntpp = c["sorted"]
    out = c["out"].clone().view(c["T"] * c["k"], -1)
    ncols = out.shape[1]
    best = (float("inf"), {})
    for sub_m, block_n, n_split in ((64, 128, 1), (64, 256, 1), (32, 256, 4), (16, 512, 4), (64, 128, 8)):
        n_per = triton.cdiv(triton.cdiv(ncols, n_split), block_n) * block_n
        grid = (triton.cdiv(sids.shape[1], sub_m), sids.shape[0], triton.cdiv(ncols, n_per))
        fn = lambda: _rmw[grid](out, sids, ntpp, sids.shape[1], out.shape[0], ncols, out.stride(0), sids.stride(0),  # noqa: E731
                                SUB_M=sub_m, BLOCK_N=block_n, N_PER=n_per, num_warps=4)
        ms = _graph_ms(fn, warmup, rep)
        if ms < best[0]:
            best = (ms, dict(sub_m=sub_m, block_n=block_n, n_split=n_split))
    return best


def plan(c: dict) -> dict:
    """name -> (entry point, layout) of what runs for this case."""
    from moe_lora_harness.kernels.triton import lora_op

    runs = {"one_shot": (lora_op.fused_moe_lora_one_shot, "sorted"),
            "two_kernel": (lora_op.fused_moe_lora_two_kernel, "sorted")}
    if c["T"] * c["k"] * c["R"] <= 1024 and c["R"] <= 64:
        runs["small_batch"] = (lora_op.fused_moe_lora_small_batch, "naive")
    runs["dispatch"] = (lora_op.fused_moe_lora, "naive" if c["naive_is_default"] else "sorted")
    return runs


def verify(c: dict, runs: dict) -> dict:
    """Max error of each path vs the float64 reference emulating its rounding, in scaled bf16 ulps."""
    from moe_lora_harness.kernels.triton import lora_op
    from moe_lora_harness.op_contract.validate import validate_call
    from moe_lora_harness.reference.lora_op import fused_moe_lora_expected
    from moe_lora_harness.reference.precision import precision

    res = {}
    eps = torch.finfo(torch.bfloat16).eps
    for name, (fn, layout) in runs.items():
        path = name if name != "dispatch" else lora_op.select_path(
            naive=layout == "naive", max_lora_rank=c["R"], num_pairs=c["T"] * c["k"])
        out = c["out"].clone()
        args, kw = op_args(c, layout, out)
        exp = fused_moe_lora_expected(validate_call(*args, **kw), precision=precision(path, torch.bfloat16))
        fn(*args, **kw)
        torch.cuda.synchronize()
        wr = exp.written
        err = ((out.double() - exp.value).abs() / exp.scale.clamp_min(1e-300))[wr]
        untouched = bool(torch.equal(out[~wr], c["out"][~wr]))
        ulps = float(err.max()) / eps if err.numel() else 0.0
        res[name] = dict(path=path, max_scaled_ulps=ulps, untouched_exact=untouched, written=int(wr.sum()),
                         ok=untouched and ulps <= 8.0 and bool(torch.isfinite(out.float()).all()))
    return res


def time_case(c: dict, runs: dict, warmup: int, rep: int, graph: bool) -> dict:
    """Eager and graph-replay medians (ms) of each run."""
    import triton

    res = {}
    for name, (fn, layout) in runs.items():
        out = c["out"].clone()
        args, kw = op_args(c, layout, out)
        fn(*args, **kw)  # compile
        torch.cuda.synchronize()
        res[name] = triton.testing.do_bench(lambda: fn(*args, **kw), warmup=warmup, rep=rep, return_mode="median")
        if graph:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    fn(*args, **kw)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(10):
                    fn(*args, **kw)
            torch.cuda.synchronize()
            res[name + "_graph"] = triton.testing.do_bench(g.replay, warmup=warmup, rep=rep, return_mode="median") / 10
            del g
    return res


def _graph_ms(fn, warmup: int, rep: int) -> float:
    """Median ms of one call, from CUDA-graph replays of 10 calls."""
    import triton

    fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    return triton.testing.do_bench(g.replay, warmup=warmup, rep=rep, return_mode="median") / 10


def sweep_case(c: dict, warmup: int, rep: int) -> list:
    """Greedy coordinate search over launch configs around the heuristics (one-shot; small-batch when
    eligible), graph-replay medians in ms: [(path, config dict, ms | error), ...], heuristic first."""
    import dataclasses

    from moe_lora_harness.kernels.triton import one_shot, small_batch

    # (knob, values) in visiting order; split_k and npid come round twice (they trade against each other)
    plans = [("one_shot", "sorted", one_shot.choose_config, one_shot.run_one_shot,
              [("split_k", (1, 2, 4, 8, 16)), ("npid", (1, 2, 4, 8, 16, 32)), ("sub_m", (16, 32, 64)),
               ("block_k", (64, 128, 256, 512)), ("block_n", (64, 128, 256)), ("num_warps", (4, 8)),
               ("num_stages", (2, 3, 4)), ("expand_stages", (0, 2, 3)), ("maxnreg", (0, 128, 168)),
               ("prefetch", (False, True)),
               ("two_slices", (True, False) if c["S"] == 2 else ()),
               ("split_k", (1, 2, 4, 8, 16)), ("npid", (1, 2, 4, 8, 16))])]
    if c["T"] * c["k"] * c["R"] <= 1024:
        plans.append(("small_batch", "naive", small_batch.choose_config, small_batch.run_small_batch,
                      [("block_k", (128, 256, 512, 1024)), ("n_chunks", (1, 2, 4, 8, 16, 32, 64)),
                       ("block_n", (32, 64, 128)), ("num_warps", (4, 8)), ("num_stages", (1, 2, 3))]))
    res = []
    for path, layout, choose, run, knobs in plans:
        call = op_call(c, layout, c["out"].clone())
        seen = {}

        def timed(cfg):
            key = tuple(sorted(dataclasses.asdict(cfg).items()))
            if key not in seen:
                try:
                    seen[key] = _graph_ms(lambda: run(call, cfg), warmup, rep)
                except Exception as e:  # noqa: BLE001 - report and continue the sweep
                    seen[key] = f"error {type(e).__name__}: {str(e)[:60]}"
                res.append((path, dataclasses.asdict(cfg), seen[key]))
            return seen[key] if isinstance(seen[key], float) else float("inf")

        best = choose(call)
        best_ms = timed(best)
        if path == "one_shot":
            from moe_lora_harness.kernels.triton.two_kernel import run_two_kernel
            try:
                res.append(("two_kernel", {}, _graph_ms(lambda: run_two_kernel(call), warmup, rep)))
            except Exception as e:  # noqa: BLE001
                res.append(("two_kernel", {}, f"error {e}"))
        for kn, vals in knobs:
            for v in vals:
                cand = dataclasses.replace(best, **{kn: v})
                if path == "one_shot" and cand.sub_m > call.block_m:
                    continue
                ms = timed(cand)
                if ms < best_ms:
                    best, best_ms = cand, ms
    return res


def load_anchors(path: pathlib.Path) -> dict:
    """vLLM figures keyed by (model, R, T, which); empty if the file is absent."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {(r["model"], r["R"], r["T"], r["which"]): r for r in rows}


def vllm_best(anchor: dict | None) -> tuple[float | None, str]:
    """Fastest vLLM path's graph time and its name."""
    if not anchor:
        return None, ""
    cands = {k[:-6]: v for k, v in anchor.items() if k.endswith("_graph") and v}
    if not cands:
        return None, ""
    name = min(cands, key=cands.get)
    return cands[name], name


def gathered_floor_ms(r: dict, bw: float) -> float | None:
    """The floor with the output's read + write timed as the measured gathered-row RMW instead of a copy:
    floor - (output bytes read + written) / bw + rmw_floor_ms. None without an RMW measurement."""
    if not r.get("rmw_floor_ms") or not bw:
        return None
    H, I, E, k = MODELS[r["model"]]
    S, N = (2, I) if r["which"] == "w13" else (1, H)
    out_ms = 2 * (r["T"] * k * S * N * 2) / bw * 1e3
    return r["floor_ms"] - out_ms + r["rmw_floor_ms"]


def summarize(rows: list, anchors: dict, bw: float = 0.0) -> tuple[str, dict]:
    """Markdown table and the target checks (dispatch vs vLLM best, one-shot vs two-kernel, floor)."""
    lines = ["| model | which | R | T | floor | one_shot | two_kernel | small_batch | dispatch (path) | "
             "vLLM best (path) | disp/vLLM | 1shot/2k | disp/floor | gathered floor | disp/gathered | verify |",
             "|" + "---|" * 16]
    ratios, wins, os_wins, floor_ok, n_floor, rmw_ok, n_rmw = [], 0, 0, 0, 0, 0, 0

    def us(v):
        return f"{v * 1000:.1f}" if isinstance(v, float) else "-"

    def rat(v):
        return f"{v:.2f}" if isinstance(v, float) else "-"

    for r in rows:
        t = r["times"]
        best, best_name = vllm_best(anchors.get((r["model"], r["R"], r["T"], r["which"])))
        disp, o, tk = t.get("dispatch_graph"), t.get("one_shot_graph"), t.get("two_kernel_graph")
        ratio = disp / best if (disp and best) else None
        if ratio is not None:
            ratios.append(ratio)
            wins += ratio <= 1.0
        os_wins += bool(o and tk and o < tk)
        fr = disp / r["floor_ms"] if disp else None
        if r["T"] >= 1024 and fr is not None:
            n_floor += 1
            floor_ok += fr <= 1.5
        rmw = gathered_floor_ms(r, bw)
        rr = disp / rmw if (disp and rmw) else None
        if rr is not None:
            n_rmw += 1
            rmw_ok += rr <= 1.5
        ver = r.get("verify")
        ver = "-" if not ver else ("ok" if all(v["ok"] for v in ver.values()) else "FAIL")
        lines.append(
            f"| {r['model']} | {r['which']} | {r['R']} | {r['T']} | {us(r['floor_ms'])} | {us(o)} | {us(tk)} | "
            f"{us(t.get('small_batch_graph'))} | {us(disp)} ({r['dispatch_path']}) | {us(best)} ({best_name or '-'}) | "
            f"{rat(ratio)} | {rat(o / tk if o and tk else None)} | {rat(fr)} | {us(rmw)} | {rat(rr)} | {ver} |")
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
    summary = dict(
        shapes=len(rows), compared_with_vllm=len(ratios), dispatch_at_or_below_vllm_best=wins,
        geomean_dispatch_over_vllm_best=geo, one_shot_faster_than_two_kernel=os_wins,
        dispatch_within_1p5x_floor_at_T_ge_1024=f"{floor_ok}/{n_floor}",
        dispatch_within_1p5x_gathered_floor=f"{rmw_ok}/{n_rmw}",
    )
    lines += ["", "Times in microseconds (CUDA-graph replay of 10 calls / 10). " + json.dumps(summary)]
    return "\n".join(lines), summary


def resummarize(paths: list, anchor_path: pathlib.Path, out: str | None, md_path: str | None) -> int:
    """Merge result JSON files (later rows win per shape), print and write the table and summary."""
    merged, bws, sources = {}, [], []
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        bws.append(data["copy_bw"])
        for r in data["rows"]:
            merged[(r["model"], r["which"], r["R"], r["T"])] = dict(r, source=pathlib.Path(path).name)
        sources.append(pathlib.Path(path).name)
    rows = list(merged.values())
    md, summary = summarize(rows, load_anchors(anchor_path), bws[0])
    summary["sources"] = sources
    md += "\nMerged from " + ", ".join(sources) + " (a later file's rows replace an earlier one's for the same shape)."
    print(md)
    if out:
        pathlib.Path(out).write_text(json.dumps(dict(copy_bw=bws[0], rows=rows, summary=summary), indent=1))
    if md_path:
        pathlib.Path(md_path).write_text(md + "\n")
    return 0


def main(argv=None) -> int:
    """Run the benchmark; print the table; write --out JSON and --md Markdown."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="subset: T 1,128,4096, R 16")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--T", default=None, help="comma-separated token counts")
    p.add_argument("--R", default=None, help="comma-separated ranks")
    p.add_argument("--which", default="w13,w2")
    p.add_argument("--out", default=None, help="JSON output path")
    p.add_argument("--md", default=None, help="Markdown output path")
    p.add_argument("--anchors", default=str(ANCHOR_DEFAULT), help="vLLM anchor JSON (tolerated if absent)")
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--verify-all", action="store_true", help="verify every shape (default: T <= 128, else skip)")
    p.add_argument("--checked", action="store_true", help="keep the id-range check (a sync) in eager calls")
    p.add_argument("--sweep", action="store_true", help="time one-shot configs around the heuristic instead")
    p.add_argument("--shapes", default=None, help="explicit shapes model:which:R:T,... (instead of the grid)")
    p.add_argument("--no-rmw-floor", action="store_true",
                   help="skip the gathered floor (output rows' RMW timed in the sorted layout; T >= 1024)")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting new shapes after this many seconds")
    p.add_argument("--summarize", default=None, metavar="JSON[,JSON...]",
                   help="no GPU: rebuild the table from result files; a later file's rows replace an earlier "
                        "one's for the same shape (a follow-up run after a heuristic change)")
    a = p.parse_args(argv)
    if a.summarize:
        return resummarize(a.summarize.split(","), pathlib.Path(a.anchors), a.out, a.md)
    if not torch.cuda.is_available():
        print("bench_lora_op: needs a CUDA device", file=sys.stderr)
        return 2
    if not a.checked:
        os.environ["MOE_LORA_UNCHECKED"] = "1"
    Ts = [int(v) for v in a.T.split(",")] if a.T else ([1, 128, 4096] if a.quick else list(T_ALL))
    Rs = [int(v) for v in a.R.split(",")] if a.R else ([16] if a.quick else list(R_ALL))
    anchors = load_anchors(pathlib.Path(a.anchors))
    if not anchors:
        print(f"(no vLLM anchors at {a.anchors}: comparing our paths only)")
    t0 = time.time()
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    if a.shapes:
        shapes = [(m, int(r), int(t), w) for m, w, r, t in (v.split(":") for v in a.shapes.split(","))]
    else:
        shapes = [(m, R, T, w) for m in a.models.split(",") for R in Rs for T in Ts for w in a.which.split(",")]
    for model, R, T, which in shapes:
        if time.time() - t0 > a.budget_s:
            print(f"budget reached: skipping {model} R={R} T={T} {which}")
            continue
        c = build_case(model, which, T, R)
        if a.sweep:
            res = sweep_case(c, 5, 20)
            tk = [r[2] for r in res if r[0] == "two_kernel"]
            print(f"SWEEP {model} {which} R={R} T={T} two_kernel: {tk[0] * 1e3 if tk and isinstance(tk[0], float) else tk} us")
            for path in ("one_shot", "small_batch"):
                mine = [r for r in res if r[0] == path]
                if not mine:
                    continue
                ok = [r for r in mine if isinstance(r[2], float)]
                best = min(ok, key=lambda r: r[2]) if ok else None
                h = mine[0][2]
                print(f"SWEEP {model} {which} R={R} T={T} {path}: heuristic "
                      f"{h * 1e3 if isinstance(h, float) else h} us {mine[0][1]} | best "
                      f"{best[2] * 1e3 if best else float('nan'):.1f} us {best[1] if best else ''}", flush=True)
            rows.append(dict(model=model, which=which, R=R, T=T, sweep=res))
            continue
        runs = plan(c)
        from moe_lora_harness.kernels.triton import lora_op
        row = dict(model=model, which=which, R=R, T=T, floor_ms=floor_bytes(c) / bw * 1e3,
                   dispatch_layout=runs["dispatch"][1],
                   dispatch_path=lora_op.select_path(naive=runs["dispatch"][1] == "naive",
                                                     max_lora_rank=R, num_pairs=T * c["k"]))
        if not a.no_verify and (a.verify_all or T <= 128):
            row["verify"] = verify(c, runs)
            bad = {k: v for k, v in row["verify"].items() if not v["ok"]}
            if bad:
                print(f"VERIFY FAILED {model} {which} R={R} T={T}: {bad}")
        row["times"] = time_case(c, runs, a.warmup, a.rep, not a.no_graph)
        if T >= 1024 and not a.no_rmw_floor and not a.no_graph:
            row["rmw_floor_ms"], row["rmw_floor_cfg"] = rmw_floor_ms(c, a.warmup, a.rep)
        rows.append(row)
        tt = row["times"]
        print(f"{model:9s} {which} R={R:3d} T={T:5d} floor={row['floor_ms'] * 1e3:7.1f}us  " + "  ".join(
            f"{k}={v * 1e3:.1f}" for k, v in tt.items() if k.endswith("_graph")), flush=True)
        del c
        torch.cuda.empty_cache()
    if a.sweep:
        if a.out:
            pathlib.Path(a.out).write_text(json.dumps(dict(rows=rows), indent=1))
        return 0
    md, summary = summarize(rows, anchors, bw)
    print(md)
    print(f"total {time.time() - t0:.0f} s")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(dict(copy_bw=bw, rows=rows, summary=summary), indent=1))
    if a.md:
        pathlib.Path(a.md).write_text(md + "\n")
    failed = [r for r in rows if any(not v["ok"] for v in r.get("verify", {}).values())]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
