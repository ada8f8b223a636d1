"""Benchmark the base expert pipeline on a GPU (not a test): align, w13 GEMM, activation, w2 GEMM, moe_sum.

Kernel level (this part): per model shape (MODELS) and T, bf16, the pipeline on each base path:
  triton  moe_align_block_size + fused_moe_gemm (w13) + silu_and_mul (torch ops) + fused_moe_gemm (w2,
          routed weight) + moe_sum;
  oai     permuted layout: grouped_gemm (gather) + activation + grouped_gemm (permuted x, weight) +
          scatter_sum (permute_pairs runs outside the timed region: it syncs for P_local);
  int4 / int8  the triton path with weight-only quantized w13/w2 dequantized inside the GEMM
          (int4_g128 needs H and I divisible by 128; skipped otherwise).
Times are CUDA-graph replay medians (triton.testing.do_bench) per forward. Each case is first checked
against a torch float32-accumulation pipeline with the same bf16 rounding points (rel_err; ok when the
aggregate error is below one bf16 eps, i.e. at most ~1-ulp flips where fp32 summation orders differ).
Expert level: FusedMoEKernel(no-EP prepare/finalize, experts).apply per backend of kernels/experts
(triton, gated_fast, oai [swigluoai], marlin_int4, marlin_int8), without and with LoRA (--rank, --loras),
and the LoRA overhead ratio ms_lora / ms_base; a backend whose is_supported_config declines the model
(e.g. gated_fast on I % 128 != 0) is listed as skipped with its reason. Select with --levels/--backends.

  python bench/bench_experts.py --out experts.json --md experts.md [--quick] [--budget-s 600]
      [--models qwen3moe,mixtral] [--T 1,16] [--paths triton,oai,int4,int8]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import time


import torch  # noqa: E402

from shapes import MODELS, T_ALL  # noqa: E402
T_QUICK = (1, 128, 1024)
PATHS = ("triton", "oai", "int4", "int8")
PATHS_QUICK = ("triton", "int4")


def time_graph(fn, warmup: int = 25, rep: int = 100, calls_per_graph: int = 5) -> float:
    """Median ms of one fn() call, from do_bench over CUDA-graph replays of `calls_per_graph` calls.

    fn runs twice on a side stream first (compiles kernels, allocator warm-up), then is captured.
    """
    import triton

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls_per_graph):
            fn()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(g.replay, warmup=warmup, rep=rep, return_mode="median") / calls_per_graph
    del g
    return ms


def silu_and_mul(cache1: torch.Tensor) -> torch.Tensor:
    """(M, 2I) -> (M, I): rnd(fp32(rnd(silu(g))) * u) with gate = first half (spec 6), torch ops."""
    half = cache1.shape[1] // 2
    g, u = cache1[:, :half].float(), cache1[:, half:].float()
    return (torch.nn.functional.silu(g).to(cache1.dtype).float() * u).to(cache1.dtype)


def build_weights(model: str, seed: int = 0) -> dict:
    """Random bf16 expert weights on the GPU for one model: w13 (E, 2I, H), w2 (E, H, I); quantized copies lazily."""
    H, I, E, k = MODELS[model]
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, device=dev, dtype=dt, generator=g) / math.sqrt(H)
    w2 = torch.randn(E, H, I, device=dev, dtype=dt, generator=g) / math.sqrt(I)
    return dict(model=model, H=H, I=I, E=E, k=k, w13=w13, w2=w2, quant={})


def build_case(weights: dict, T: int, seed: int = 1) -> dict:
    """One (model, T) case: the model's weights plus random bf16 hidden states and routing (distinct experts)."""
    H, E, k = weights["H"], weights["E"], weights["k"]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed + T)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
    topk = torch.rand(T, E, device=dev, generator=g).argsort(dim=1)[:, :k].to(torch.int32).contiguous()
    tw = torch.softmax(torch.rand(T, k, device=dev, generator=g), dim=-1).float()
    return dict(weights, T=T, x=x, topk=topk, tw=tw)


def quantized(weights: dict, scheme: str):
    """[(QuantWeights, dequantized bf16)] for w13 and w2 (random codes and scales; cached per model), or
    None when int4_g128 does not divide K."""
    from moe_lora_harness.kernels.triton.quant_gemm import pack_weights

    if scheme in weights["quant"]:
        return weights["quant"][scheme]
    H, I, E = weights["H"], weights["I"], weights["E"]
    if scheme == "int4_g128" and (H % 128 or I % 128):
        return None
    lo, hi, group = (-8, 7, 128) if scheme == "int4_g128" else (-127, 127, None)
    res = []
    for N, K in ((2 * I, H), (H, I)):
        q = torch.randint(lo, hi + 1, (E, N, K), device="cuda", dtype=torch.int8)
        sshape = (E, N) if group is None else (E, N, K // group)
        sc = (torch.rand(sshape, device="cuda") / (hi * math.sqrt(K)) + 1e-4).to(torch.bfloat16)
        s_full = sc.float().unsqueeze(2) if group is None else sc.float().repeat_interleave(group, dim=2)
        res.append((pack_weights(q, sc, scheme), (q.float() * s_full).to(torch.bfloat16)))
        del q, s_full
    weights["quant"][scheme] = res
    return res


def pipeline(c: dict, path: str):
    """(fn, out, w13_dense, w2_dense) for one path; fn() runs one forward into `out` (graph-capturable)."""
    from moe_lora_harness.kernels.triton.fused_moe_gemm import choose_block_m, fused_moe_gemm
    from moe_lora_harness.kernels.triton.grouped_gemm import grouped_gemm, permute_pairs, scatter_sum
    from moe_lora_harness.kernels.triton.moe_align import moe_align_block_size
    from moe_lora_harness.kernels.triton.moe_sum import moe_sum

    T, H, I, E, k = c["T"], c["H"], c["I"], c["E"], c["k"]
    dt, dev = torch.bfloat16, torch.device("cuda")
    x, topk, tw = c["x"], c["topk"], c["tw"]
    out = torch.empty(T, H, device=dev, dtype=dt)
    w13, w2, q13, q2 = c["w13"], c["w2"], None, None
    if path in ("int4", "int8"):
        qs = quantized(c, "int4_g128" if path == "int4" else "int8_channel")
        if qs is None:
            return None
        (q13, w13), (q2, w2) = qs
    bm = choose_block_m(T * k, E)
    if path == "oai":
        perm, seg = permute_pairs(topk, E)
        P = perm.numel()
        y1 = torch.empty(P, 2 * I, device=dev, dtype=dt)
        y2 = torch.empty(P, H, device=dev, dtype=dt)

        def fn():
            grouped_gemm(y1, x, w13, perm, seg, x_row_div=k, block_m=bm)
            a = silu_and_mul(y1)
            grouped_gemm(y2, a, w2, perm, seg, x_row_div=1, x_permuted=True, topk_weights=tw,
                         mul_routed_weight=True, block_m=bm)
            scatter_sum(out, y2, perm, k)
        return fn, out, w13, w2

    cache1 = torch.empty(T * k, 2 * I, device=dev, dtype=dt)
    cache3 = torch.empty(T * k, H, device=dev, dtype=dt)
    d13, d2 = (None, None) if q13 is not None else (w13, w2)

    def fn():
        s, e, n = moe_align_block_size(topk, bm, E)
        fused_moe_gemm(cache1, x, d13, s, e, n, top_k=k, x_row_div=k, block_m=bm, quant=q13)
        a = silu_and_mul(cache1)
        fused_moe_gemm(cache3, a, d2, s, e, n, top_k=k, x_row_div=1, topk_weights=tw, mul_routed_weight=True,
                       block_m=bm, quant=q2)
        moe_sum(cache3.view(T, k, H), out)
    return fn, out, w13, w2


def torch_reference(c: dict, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The same pipeline with torch ops: fp32 accumulation, bf16 at the spec's rounding points."""
    T, H, k = c["T"], c["H"], c["k"]
    flat = c["topk"].reshape(-1).long()
    cache1 = torch.empty(T * k, w13.shape[1], device="cuda", dtype=torch.bfloat16)
    cache3 = torch.empty(T * k, H, device="cuda", dtype=torch.bfloat16)
    for e in torch.unique(flat).tolist():
        rows = (flat == e).nonzero().squeeze(1)
        cache1[rows] = (c["x"][rows // k].float() @ w13[e].float().t()).to(torch.bfloat16)
    a = silu_and_mul(cache1)
    wf = c["tw"].reshape(-1)
    for e in torch.unique(flat).tolist():
        rows = (flat == e).nonzero().squeeze(1)
        cache3[rows] = ((a[rows].float() @ w2[e].float().t()) * wf[rows, None]).to(torch.bfloat16)
    return cache3.view(T, k, H).float().sum(1).to(torch.bfloat16)


def rel_norm_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp32 (ref's norm floored so an all-zero reference cannot divide by 0)."""
    ref = ref.float()
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def case_metrics(c: dict, path: str, ms: float) -> dict:
    """Effective TFLOP/s (2 GEMMs over T*k pairs) and weight bandwidth (bytes of the experts hit once)."""
    H, I, k = c["H"], c["I"], c["k"]
    flops = 2.0 * c["T"] * k * (2 * I * H + H * I)
    hit = int(torch.unique(c["topk"]).numel())
    per_w = {"int4": 0.5, "int8": 1.0}.get(path, 2.0)
    wbytes = hit * 3 * I * H * per_w
    return dict(tflops=flops / (ms * 1e-3) / 1e12, weight_gbps=wbytes / (ms * 1e-3) / 1e9, experts_hit=hit)


def kernel_level_rows(models, Ts, paths, warmup: int, rep: int, deadline: float) -> list:
    """One row per (model, T, path): verification against torch, then the graph-replay median."""
    rows = []
    eps = torch.finfo(torch.bfloat16).eps
    for model in models:
        weights = build_weights(model)
        for T in Ts:
            c = build_case(weights, T)
            for path in paths:
                if time.time() > deadline:
                    rows.append(dict(level="kernel", model=model, T=T, path=path, skipped="budget"))
                    continue
                built = pipeline(c, path)
                if built is None:
                    rows.append(dict(level="kernel", model=model, T=T, path=path, skipped="int4 needs H, I % 128"))
                    continue
                fn, out, w13, w2 = built
                row = dict(level="kernel", model=model, T=T, path=path)
                try:
                    fn()
                    torch.cuda.synchronize()
                    if T <= 1024:
                        rel = rel_norm_err(out, torch_reference(c, w13, w2))
                        row.update(rel_err=rel, ok=bool(rel <= eps and torch.isfinite(out.float()).all()))
                    row["ms"] = time_graph(fn, warmup, rep)
                    row.update(case_metrics(c, path, row["ms"]))
                except Exception as exc:  # noqa: BLE001 - a failing case is reported, the sweep goes on
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(row)
                print(json.dumps(row), flush=True)
            del c
        del weights
        torch.cuda.empty_cache()
    return rows


def markdown_table(rows: list, columns: list) -> str:
    """A Markdown table of `columns` over `rows` (floats to 4 significant digits, missing cells blank)."""
    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "".join("| " + " | ".join(cell(r.get(c)) for c in columns) + " |\n" for r in rows)


KERNEL_COLUMNS = ["model", "T", "path", "ms", "tflops", "weight_gbps", "experts_hit", "rel_err", "ok", "skipped",
                  "error"]


# ----------------------------------------------------------------------------- expert level (kernels/experts)

EXPERT_BACKENDS = ("triton", "gated_fast", "oai", "marlin_int4", "marlin_int8")
EXPERT_BACKENDS_QUICK = ("triton", "gated_fast", "marlin_int4")


def expert_setup(c: dict, backend: str, rank: int, loras: int):
    """(experts class, config without LoRA, config with LoRA, w13, w2, dense w13, dense w2, LoRA context),
    or a skip reason (str). Dense = the dequantized weights for marlin, else w13/w2 themselves.

    triton / gated_fast run silu; oai runs swigluoai (same w13 width); marlin_* run silu on quantized
    weights. The LoRA: `loras` adapters of rank `rank` on every expert, tokens spread over the slots.
    """
    from moe_lora_harness.kernels.experts.config import MoEConfig
    from moe_lora_harness.kernels.experts.gated_fast_experts import GatedFastExperts
    from moe_lora_harness.kernels.experts.lora_context import MoELoRAContext
    from moe_lora_harness.kernels.experts.marlin_experts import MarlinExperts
    from moe_lora_harness.kernels.experts.oai_experts import OAIExperts
    from moe_lora_harness.kernels.experts.triton_experts import TritonExperts

    cls = {"triton": TritonExperts, "gated_fast": GatedFastExperts, "oai": OAIExperts,
           "marlin_int4": MarlinExperts, "marlin_int8": MarlinExperts}[backend]
    quant = {"marlin_int4": "int4_g128", "marlin_int8": "int8_channel"}.get(backend, "none")
    act = "swigluoai" if backend == "oai" else "silu"
    T, H, I, E, k = c["T"], c["H"], c["I"], c["E"], c["k"]
    base = MoEConfig("cuda", torch.bfloat16, act, H, I, E, k, quant=quant)
    lora_cfg = MoEConfig("cuda", torch.bfloat16, act, H, I, E, k, quant=quant, lora_enabled=True, max_lora_rank=rank)
    for cfg in (base, lora_cfg):
        ok, why = cls.is_supported_config(cfg)
        if not ok:
            return f"{cls.name}: {why}"
    w13, w2 = d13, d2 = c["w13"], c["w2"]
    if quant != "none":
        qs = quantized(c, quant)
        if qs is None:
            return "int4 needs H, I % 128"
        (w13, d13), (w2, d2) = qs
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(1000 + T)

    def rnd(*shape, fan_in):
        return (torch.randn(*shape, device=dev, dtype=torch.float32, generator=g) / math.sqrt(fan_in)).to(dt)
    L, R = loras, rank
    ctx = MoELoRAContext(
        w13_lora_a_stacked=[rnd(L, E, R, H, fan_in=H) for _ in range(2)],
        w13_lora_b_stacked=[rnd(L, E, I, R, fan_in=R) for _ in range(2)],
        w2_lora_a_stacked=[rnd(L, E, R, I, fan_in=I)], w2_lora_b_stacked=[rnd(L, E, H, R, fan_in=R)],
        adapter_enabled=torch.tensor([1] * L + [0], dtype=torch.int32, device=dev), max_loras=L, top_k=k,
        w13_num_slices=2, local_num_experts=E,
        token_lora_mapping=torch.randint(0, L, (T,), device=dev, dtype=torch.int32, generator=g))
    return cls, base, lora_cfg, w13, w2, d13, d2, ctx


def expert_forward(cls, cfg, c, w13, w2, ctx):
    """(fn, out): fn() runs FusedMoEKernel(no-EP prepare/finalize, cls(cfg)).apply into `out`."""
    from moe_lora_harness.kernels.experts.modular import FusedMoEKernel
    from moe_lora_harness.kernels.experts.prepare_finalize import NoEPPrepareAndFinalize

    kernel = FusedMoEKernel(NoEPPrepareAndFinalize(), cls(cfg))
    out = torch.empty(c["T"], c["H"], device="cuda", dtype=torch.bfloat16)

    def fn():
        kernel.apply(c["x"], w13, w2, c["tw"], c["topk"], lora_ctx=ctx, output=out)
    return fn, out


def time_eager(fn, warmup: int, rep: int) -> float:
    """Median ms of fn() without a CUDA graph (for paths that sync the host, e.g. the OAI permutation)."""
    import triton
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def expert_level_rows(models, Ts, backends, rank: int, loras: int, warmup: int, rep: int, deadline: float) -> list:
    """One row per (model, T, backend): forward without and with LoRA, and the LoRA overhead ratio.

    CUDA-graph replay medians, except for oai (its permute_pairs reads P_local on the host: eager
    do_bench, marked graph=False). rel_vs_triton: relative distance of the LoRA forward to the Triton
    experts' on the same inputs and activation (dequantized weights for marlin), for information.
    """
    from moe_lora_harness.kernels.experts.triton_experts import TritonExperts

    rows = []
    for model in models:
        weights = build_weights(model)
        for T in Ts:
            c = build_case(weights, T)
            for backend in backends:
                row = dict(level="expert", model=model, T=T, backend=backend, rank=rank, loras=loras)
                if time.time() > deadline:
                    rows.append(dict(row, skipped="budget"))
                    continue
                try:
                    setup = expert_setup(c, backend, rank, loras)
                    if isinstance(setup, str):
                        rows.append(dict(row, skipped=setup))
                        continue
                    cls, base_cfg, lora_cfg, w13, w2, d13, d2, ctx = setup
                    graph = backend != "oai"
                    timer = (lambda f: time_graph(f, warmup, rep)) if graph else (lambda f: time_eager(f, warmup, rep))
                    fn0, _ = expert_forward(cls, base_cfg, c, w13, w2, None)
                    fn1, out1 = expert_forward(cls, lora_cfg, c, w13, w2, ctx)
                    fn1()
                    torch.cuda.synchronize()
                    if backend != "triton":
                        fn_ref, ref = expert_forward(TritonExperts, dataclasses.replace(lora_cfg, quant="none"), c,
                                                     d13, d2, ctx)
                        fn_ref()
                        row["rel_vs_triton"] = rel_norm_err(out1, ref)
                    row.update(graph=graph, ms_base=timer(fn0), ms_lora=timer(fn1))
                    row["lora_overhead"] = row["ms_lora"] / row["ms_base"]
                except Exception as exc:  # noqa: BLE001 - a failing case is reported, the sweep goes on
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(row)
                print(json.dumps(row), flush=True)
            del c
        del weights
        torch.cuda.empty_cache()
    return rows


EXPERT_COLUMNS = ["model", "T", "backend", "ms_base", "ms_lora", "lora_overhead", "graph", "rel_vs_triton",
                  "skipped", "error"]


def parse_args(argv=None):
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--T", default=None, help="comma-separated token counts (default: all, or the quick subset)")
    p.add_argument("--paths", default=None, help=f"comma-separated subset of {','.join(PATHS)}")
    p.add_argument("--quick", action="store_true", help=f"T in {T_QUICK}, paths {PATHS_QUICK}")
    p.add_argument("--budget-s", type=float, default=1800.0, help="stop starting new cases after this many seconds")
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--levels", default="kernel,expert", help="comma-separated subset of kernel,expert")
    p.add_argument("--backends", default=None,
                   help=f"expert level: comma-separated subset of {','.join(EXPERT_BACKENDS)}")
    p.add_argument("--rank", type=int, default=16, help="expert level: LoRA rank")
    p.add_argument("--loras", type=int, default=4, help="expert level: number of LoRA slots in use")
    p.add_argument("--out", default=None, help="JSON results file")
    p.add_argument("--md", default=None, help="Markdown results file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Run the kernel-level sweep, write JSON/Markdown; exit 1 if a case failed its check or raised."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_experts needs a CUDA device", file=sys.stderr)
        return 2
    os.environ.setdefault("MOE_LORA_UNCHECKED", "1")  # no id-range syncs in the timed eager calls
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; known {sorted(MODELS)}")
    Ts = [int(t) for t in args.T.split(",")] if args.T else list(T_QUICK if args.quick else T_ALL)
    paths = args.paths.split(",") if args.paths else list(PATHS_QUICK if args.quick else PATHS)
    bad = sorted(set(paths) - set(PATHS))
    if bad:
        raise SystemExit(f"--paths: unknown {bad}; known {PATHS}")
    levels = [v for v in args.levels.split(",") if v]
    if set(levels) - {"kernel", "expert"}:
        raise SystemExit(f"--levels: unknown {sorted(set(levels) - {'kernel', 'expert'})}; known kernel, expert")
    backends = args.backends.split(",") if args.backends else list(
        EXPERT_BACKENDS_QUICK if args.quick else EXPERT_BACKENDS)
    if set(backends) - set(EXPERT_BACKENDS):
        raise SystemExit(f"--backends: unknown {sorted(set(backends) - set(EXPERT_BACKENDS))}; known {EXPERT_BACKENDS}")
    start = time.time()
    rows = []
    if "kernel" in levels:
        rows += kernel_level_rows(models, Ts, paths, args.warmup, args.rep, start + args.budget_s)
    if "expert" in levels:
        rows += expert_level_rows(models, Ts, backends, args.rank, args.loras, args.warmup, args.rep,
                                  start + args.budget_s)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, dtype="bfloat16",
                seconds=round(time.time() - start, 1))
    import triton
    meta["triton"] = triton.__version__
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    if args.md:
        text = f"# Expert kernels benchmark\n\n{json.dumps(meta)}\n\n## Kernel level (base pipeline)\n\n"
        text += markdown_table([r for r in rows if r["level"] == "kernel"], KERNEL_COLUMNS)
        text += (f"\n## Expert level (FusedMoEKernel forward, LoRA rank {args.rank}, {args.loras} LoRAs)\n\n"
                 + markdown_table([r for r in rows if r["level"] == "expert"], EXPERT_COLUMNS))
        pathlib.Path(args.md).write_text(text)
    failed = [r for r in rows if r.get("error") or r.get("ok") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
