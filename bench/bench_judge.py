"""Benchmark the judge (not a test): its time per expert-level case, on the host or on a GPU, at the catalogue's
shapes (harness.served.models: MODELS, case_fields), at decode (T = 1, 64) and prefill (T = 4096, 16384) sizes.

Per case (bf16, 4 LoRA slots of rank 16, every token with an adapter), median seconds of the judge's phases as
the runner runs them (harness.execution.runner.expectations, then the comparison of harness.execution.runner._judge_execution):
  build      harness.build.builders.build_expert_inputs on the device (a CUDA device draws there, expert by expert)
  digest     harness.execution.execute.inputs_digest of those inputs (on a GPU: harness.judge.tensor_digest, where they lie)
  truth      the float64 reference with its magnitudes (reference.experts, one expert's weights at a time)
  emulation  the declared model's value (one_shot)
  compare    harness.judge.compare.compare_written of an output (the emulation in bf16, standing in for the backend's)
and on a GPU the peak memory the judge allocated (torch.cuda.max_memory_allocated). A host case whose estimate
(the host's measured float64 GEMM, randn and conversion rates; the case's FLOPs, weights and memory) passes
--host-limit-s or the free memory is skipped, with its estimate printed.

  python bench/bench_judge.py --device cuda --out DIR      # every model x T on the GPU (the lead's H200 run)
  python bench/bench_judge.py --device cpu --quick          # host smoke form: decode sizes, at most 8 experts,
                                                            # 15 s limit per case
  options: --models deepseek-v3,qwen3-30b-a3b  --tokens 1,64  --repeats 3  --host-limit-s 120  --max-experts N
           --profile PATH   one more judged case of the first model and token count under torch.profiler: its
                            hottest operations (by self time on the device, and grouped by the Python frames that
                            called them) written to PATH (where the judge's time goes, beside the phases)
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import time

import torch

from moe_lora_harness.harness.build.builders import build_expert_inputs, torch_dtype
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.judge.compare import compare_written
from moe_lora_harness.harness.execution.execute import inputs_digest, release_device_memory
from moe_lora_harness.harness.judge.expectation import allowances, judging
from moe_lora_harness.harness.build.expert_runner import expert_forward
from moe_lora_harness.harness.served.models import MODELS, case_fields, model_named
from moe_lora_harness.reference.activations import is_gated
from moe_lora_harness.reference.precision import bound_dtype, precision

DECODE, PREFILL = (1, 64), (4096, 16384)
LORAS, RANK = 4, 16
DECLARED = "one_shot"
PHASES = ("build", "digest", "truth", "emulation", "compare")
QUICK_LIMIT_S, HOST_LIMIT_S = 15.0, 120.0
QUICK_EXPERTS = 8


def bench_case(model, T: int, max_experts: int | None = None) -> Case:
    """The benchmarked case of a catalogue model at T tokens (its checkpoint format aside: bf16 weights), with at
    most `max_experts` experts (at least top_k) when given: the host's smoke form."""
    fields = case_fields(model)
    if max_experts is not None:
        fields["E"] = min(fields["E"], max(max_experts, fields["top_k"]))
    return Case(level="expert", T=T, dtype="bfloat16", max_loras=LORAS, max_rank=RANK, seed=0, **fields)


def _sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def judge_once(case: Case, device: str) -> tuple[dict, int]:
    """({phase: seconds}, peak bytes allocated on a GPU, else 0) of one judged case."""
    dt = torch_dtype(case)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times = {}
    _sync(device)
    t = time.perf_counter()

    def lap(name):
        nonlocal t
        _sync(device)
        now = time.perf_counter()
        times[name] = now - t
        t = now

    inp = build_expert_inputs(case, device)
    lap("build")
    inputs_digest(inp)
    lap("digest")
    forward, args, kw = expert_forward(case, inp)
    truth = forward(*args, precision=precision("exact", None), **kw)
    lap("truth")
    emu = forward(*args, precision=precision(DECLARED, dt), magnitudes=False, **kw)
    lap("emulation")
    del forward, args, kw, inp          # the runner releases the inputs here on a GPU (Expectation.release_inputs)
    output = emu.value.to(dt)           # a backend's output, as it would come back from the worker
    _sync(device)
    t = time.perf_counter()
    written, k_plus_r, names = judging(case, truth)
    compare_written(output, truth.value, emu.value, truth.scale, written, dtype=bound_dtype(DECLARED, dt),
                    k_plus_r=k_plus_r, names=names, underflow=truth.underflow, work_dtype=dt, **allowances(truth))
    lap("compare")
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
    del truth, emu, output, written
    release_device_memory(device)
    return times, peak


def profile_once(case: Case, device: str, path: pathlib.Path, rows: int = 30) -> None:
    """One judged case (judge_once) under torch.profiler; PATH gets its operations by self time on the device
    (the CPU on a host) and the same grouped by the five innermost Python frames that called them."""
    from torch.profiler import ProfilerActivity, profile
    on_gpu = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=acts, with_stack=True, record_shapes=False) as prof:
        times, _ = judge_once(case, device)
    key = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    avg = prof.key_averages()
    text = (f"{case.to_json()}\nphases under the profiler (s): "
            + ", ".join(f"{k} {v:.3f}" for k, v in times.items())
            + f"\n\nby operation, sorted by {key}\n" + avg.table(sort_by=key, row_limit=rows)
            + f"\n\nby operation and the 5 innermost Python frames, sorted by {key}\n"
            + prof.key_averages(group_by_stack_n=5).table(sort_by=key, row_limit=rows))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}", flush=True)


# ------------------------------------------------------------------------------------------ estimates


def host_rates() -> dict:
    """This host's float64 GEMM rate (FLOP/s), float64 randn rate and bf16 -> float64 |.| rate (elements/s): each
    the median of three brief measurements (a shared host is noisy)."""
    def rate(work: float, fn) -> float:
        fn()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return work / statistics.median(times)
    a, b = torch.randn(512, 512, dtype=torch.float64), torch.randn(512, 512, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1 << 22, dtype=torch.float64).to(torch.bfloat16)
    return {"gemm_flops": rate(2 * 512**3, lambda: a @ b),
            "randn_per_s": rate(1 << 22, lambda: torch.randn(1 << 22, generator=g, dtype=torch.float64)),
            "convert_per_s": rate(1 << 22, lambda: w.to(torch.float64).abs())}


def shape_of(case: Case) -> dict:
    """The case's weight elements, base GEMM FLOPs of one judged case and float64 working memory (bytes)."""
    N1 = 2 * case.I if is_gated(case.activation) else case.I
    P = case.T * case.top_k
    weights = case.E * (N1 * case.H + case.H * case.I)
    # truth: GEMM1 value + magnitude, GEMM2 value + magnitude + underflow; emulation: one of each
    flops = 2 * P * (3 * N1 * case.H + 4 * case.H * case.I)
    return {"weights": weights, "flops": flops, "pair_bytes": 8 * P * (4 * N1 + 6 * case.H + 4 * case.I)}


CONVERSIONS = 7   # weight conversions per touched expert and judged case: truth 2 (w13) + 3 (w2), emulation 1 + 1


def host_estimate(case: Case, rates: dict) -> tuple[float, int]:
    """(seconds, peak bytes) the host would need: the draws (and the float64 quotient and cast: x 1.5), each touched
    expert's conversions, the GEMMs (x 1.3 for the elementwise work)."""
    s = shape_of(case)
    N1 = 2 * case.I if is_gated(case.activation) else case.I
    touched = case.E * (1 - (1 - 1 / case.E) ** (case.T * case.top_k))     # expected distinct experts routed to
    seconds = (1.5 * s["weights"] / rates["randn_per_s"]
               + CONVERSIONS * s["weights"] * touched / case.E / rates["convert_per_s"]
               + 1.3 * s["flops"] / rates["gemm_flops"])
    largest = case.E * max(N1 * case.H, case.H * case.I)      # one float64 draw of a whole weight, and its quotient
    return seconds, 16 * largest + 2 * s["weights"] + s["pair_bytes"]


def _available_host_bytes() -> int:
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ------------------------------------------------------------------------------------------ the table


def run(device: str, models, tokens, repeats: int, host_limit_s: float, max_experts: int | None = None) -> dict:
    on_gpu = device.startswith("cuda")
    result = {"device": device, "torch": torch.__version__, "host": platform.node(), "cpu_threads":
              torch.get_num_threads(), "declared": DECLARED, "loras": LORAS, "rank": RANK, "rows": []}
    if on_gpu:
        result["gpu"] = torch.cuda.get_device_name()
        judge_once(Case(level="expert", T=8, dtype="bfloat16", seed=1), device)   # context, cuBLAS: not timed
    else:
        result["host_rates"] = host_rates()
    for model in models:
        for T in tokens:
            case = bench_case(model, T, max_experts)
            row = {"model": model.name, "T": T, "E": case.E, "E_model": model.E,
                   "regime": "decode" if T <= max(DECODE) else "prefill", "case": case.to_json()}
            if not on_gpu:
                est_s, est_bytes = host_estimate(case, result["host_rates"])
                row.update(estimate_s=est_s, estimate_gib=est_bytes / 2**30)
                avail = _available_host_bytes()
                why = (f"estimated {est_s:,.0f} s > --host-limit-s {host_limit_s:g}" if est_s > host_limit_s else
                       f"estimated {est_bytes / 2**30:.1f} GiB > {avail / 2**30:.1f} GiB available"
                       if avail and est_bytes > 0.8 * avail else "")
                if why:
                    row["skipped"] = why
                    result["rows"].append(row)
                    print(f"  skip {model.name} T={T}: {why}", flush=True)
                    continue
            runs, peaks = [], []
            try:
                for _ in range(repeats):
                    times, peak = judge_once(case, device)
                    runs.append(times)
                    peaks.append(peak)
            except torch.OutOfMemoryError as e:
                release_device_memory(device)
                row["skipped"] = f"out of memory: {str(e).splitlines()[0]}"
                result["rows"].append(row)
                print(f"  {model.name} T={T}: {row['skipped']}", flush=True)
                continue
            row["runs"] = runs
            row["median_s"] = {p: statistics.median(r[p] for r in runs) for p in PHASES}
            row["median_s"]["total"] = statistics.median(sum(r.values()) for r in runs)
            if on_gpu:
                row["peak_gib"] = max(peaks) / 2**30
            result["rows"].append(row)
            print(f"  {model.name} T={T}: {row['median_s']['total']:.3f} s", flush=True)
    return result


def table(result: dict) -> str:
    head = f"{'model':<32} {'T':>6} " + " ".join(f"{p:>10}" for p in (*PHASES, "total")) + f" {'peak GiB':>9}"
    lines = [f"judge per case on {result['device']} ({result.get('gpu', result['host'])}), torch {result['torch']}, "
             f"medians in seconds", head, "-" * len(head)]
    for r in result["rows"]:
        name = r["model"] + (f" E={r['E']}/{r['E_model']}" if r["E"] != r["E_model"] else "")
        if "skipped" in r:
            est = f" (estimate {r['estimate_s']:,.0f} s, {r['estimate_gib']:.1f} GiB)" if "estimate_s" in r else ""
            lines.append(f"{name:<32} {r['T']:>6}  skipped: {r['skipped']}{est}")
            continue
        m = r["median_s"]
        peak = f"{r['peak_gib']:>9.2f}" if "peak_gib" in r else f"{'-':>9}"
        lines.append(f"{name:<32} {r['T']:>6} " + " ".join(f"{m[p]:>10.4f}" for p in (*PHASES, "total"))
                     + f" {peak}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="folder for bench_judge-<device>.json (default: the table only)")
    ap.add_argument("--quick", action="store_true", help=f"decode sizes only, one repeat, at most {QUICK_EXPERTS} "
                    f"experts, {QUICK_LIMIT_S:g} s host limit")
    ap.add_argument("--max-experts", type=int, default=None, help="cap each model's expert count (default: none; "
                    f"--quick {QUICK_EXPERTS})")
    ap.add_argument("--models", default="", help="comma-separated catalogue names (default: every model)")
    ap.add_argument("--tokens", default="", help="comma-separated token counts (default: 1,64,4096,16384)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per case (default 3; --quick 1)")
    ap.add_argument("--host-limit-s", type=float, default=None,
                    help=f"skip host cases estimated longer (default {HOST_LIMIT_S:g}; --quick {QUICK_LIMIT_S:g})")
    ap.add_argument("--profile", default=None, metavar="PATH",
                    help="after the table, one more judged case of the first model and token count under "
                         "torch.profiler; its hottest operations written to PATH")
    a = ap.parse_args(argv)
    device = str(a.device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {device}: no CUDA device here")
    if not device.startswith("cuda") and device != "cpu":
        ap.error(f"--device must be cpu or cuda[:N]; got {device!r}")
    try:
        models = [model_named(n) for n in a.models.split(",") if n] or list(MODELS)
        tokens = [int(n) for n in a.tokens.split(",") if n] or list(DECODE if a.quick else DECODE + PREFILL)
    except ValueError as e:
        ap.error(str(e))
    if any(T < 1 for T in tokens):
        ap.error(f"--tokens must be positive counts; got {tokens}")
    repeats = a.repeats if a.repeats is not None else (1 if a.quick else 3)
    if repeats < 1:
        ap.error(f"--repeats must be >= 1; got {repeats}")
    limit = a.host_limit_s if a.host_limit_s is not None else (QUICK_LIMIT_S if a.quick else HOST_LIMIT_S)
    max_experts = a.max_experts if a.max_experts is not None else (QUICK_EXPERTS if a.quick else None)
    if max_experts is not None and max_experts < 1:
        ap.error(f"--max-experts must be >= 1; got {max_experts}")
    result = run(device, models, tokens, repeats, limit, max_experts)
    print(table(result))
    if a.out:
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"bench_judge-{device.replace(':', '')}.json"
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")
    if a.profile:
        profile_once(bench_case(models[0], tokens[0], max_experts), device, pathlib.Path(a.profile))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("MOE_LORA_HARNESS_PROFILE", "ci")
    raise SystemExit(main())
