"""Sweep the FP8 grouped GEMM's launch tiles on a GPU (an instrument for choose_config, not a test).

For each catalogued model and T, the w13 GEMM (x (T, H) -> (T*k, N1)) and the w2 GEMM ((T*k, I) -> (T*k, H), routed
weight) under fp8_w8a8 and fp8_block at every (block_m, block_n, block_k, warps, stages) of the grid, and bf16 at its
heuristic's tiles for comparison; CUDA-graph replay medians. Prints one JSON line per point and, per (model, T, gemm, scheme), the
heuristic's time beside the best point's.

  python bench/tune_fp8_gemm.py --out tune.json [--models deepseek-v3,qwen3-30b-a3b] [--T 256,4096]
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_experts import time_graph  # noqa: E402

GRID = dict(block_m=(64, 128), block_n=(128, 256), block_k=(128, 256), warps=(4, 8), stages=(3, 4))


def gemm_inputs(layer, T: int, which: str, scheme: str):
    """(fn(config) -> None, block_m for the heuristic) for one GEMM of the layer on random data."""
    from moe_lora_harness.kernels.experts.config import is_gated_activation
    from moe_lora_harness.kernels.triton.fp8_quant import quantize_activation
    from moe_lora_harness.kernels.triton.fused_moe_gemm import choose_block_m, fused_moe_gemm
    from moe_lora_harness.kernels.triton.moe_align import moe_align_block_size
    from moe_lora_harness.kernels.triton.quant_gemm import pack_weights
    from moe_lora_harness.reference.fp8 import quantize_weights
    H, I, E, k = layer.H, layer.I, layer.E, layer.top_k
    N1 = 2 * I if is_gated_activation(layer.activation) else I
    N, K = (N1, H) if which == "w13" else (H, I)
    g = torch.Generator(device="cuda").manual_seed(T)
    w = torch.empty(E, N, K, device="cuda", dtype=torch.bfloat16)
    for e in range(E):
        w[e] = (torch.randn(N, K, device="cuda", generator=g) / math.sqrt(K)).to(torch.bfloat16)
    rows = T if which == "w13" else T * k
    x = torch.randn(rows, K, device="cuda", generator=g).to(torch.bfloat16)
    topk = torch.topk(torch.rand(T, E, device="cuda", generator=g), k, dim=1).indices.to(torch.int32)
    tw = torch.rand(T, k, device="cuda", generator=g)
    out = torch.empty(T * k, N, device="cuda", dtype=torch.bfloat16)
    if scheme == "none":
        weights, xin = dict(w=w), x
    else:
        qw = pack_weights(*quantize_weights(w, scheme), scheme)
        del w
        codes, scales = quantize_activation(x, scheme)
        weights, xin = dict(w=None, quant=qw, x_scales=scales), codes
    aligns = {}

    def fn_for(config, block_m):
        if block_m not in aligns:
            aligns[block_m] = moe_align_block_size(topk, block_m, E, None)
        ids, eids, ntpp = aligns[block_m]
        extra = dict(topk_weights=tw, mul_routed_weight=True) if which == "w2" else {}

        def fn():
            fused_moe_gemm(out, xin, sorted_token_ids=ids, expert_ids=eids, num_tokens_post_padded=ntpp, top_k=k,
                           x_row_div=k if which == "w13" else 1, block_m=block_m, config=config, **weights, **extra)
        return fn
    return fn_for, choose_block_m(T * k, E)


def main(argv=None) -> int:
    from moe_lora_harness.harness.served.models import model_named
    from moe_lora_harness.kernels.triton.fused_moe_gemm import GemmConfig
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="deepseek-v3,qwen3-30b-a3b")
    p.add_argument("--T", default="256,4096")
    p.add_argument("--schemes", default="none,fp8_w8a8,fp8_block")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    rows = []
    for name, T, which, scheme in itertools.product(a.models.split(","), map(int, a.T.split(",")), ("w13", "w2"),
                                                    a.schemes.split(",")):
        layer = model_named(name)
        if scheme == "fp8_block" and (layer.H % 128 or layer.I % 128):
            continue
        fn_for, bm0 = gemm_inputs(layer, T, which, scheme)
        heur = time_graph(fn_for(None, bm0))
        best = (heur, "heuristic")
        for bm, bn, bk, warps, stages in itertools.product(*GRID.values()) if scheme != "none" else ():
            if scheme == "fp8_block" and 128 % bk:
                continue
            cfg = GemmConfig(block_n=bn, block_k=bk, group_m=8, num_warps=warps, num_stages=stages)
            try:
                ms = time_graph(fn_for(cfg, bm), warmup=10, rep=30)
            except Exception as exc:  # noqa: BLE001 - a config that does not fit is skipped
                ms = None
                print(json.dumps(dict(model=name, T=T, gemm=which, scheme=scheme, cfg=[bm, bn, bk, warps, stages],
                                      error=f"{type(exc).__name__}"[:80])), flush=True)
            if ms is not None and ms < best[0]:
                best = (ms, [bm, bn, bk, warps, stages])
        row = dict(model=name, T=T, gemm=which, scheme=scheme, heuristic_ms=heur, best_ms=best[0], best=best[1])
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
