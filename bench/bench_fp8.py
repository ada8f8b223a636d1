"""FP8 experts with LoRA against bf16 experts with LoRA on a GPU (issue 22 item 5; a benchmark, not a test).

Per catalogued model (harness/served/models.py: one TP-1 rank's H, I, E, top_k, activation, biases) and token count T:
our TritonExperts forward in bf16, fp8_w8a8 and fp8_block (where H, I % 128 == 0), each without and with LoRA
(rank 16 on w13 and w2, 4 slots, tokens spread over them), CUDA-graph replay medians (bench_experts.time_graph).
Beside each: the memory floor (the experts the batch touches, their weights once at the scheme's byte width, plus
x and the output, over the device-to-device copy bandwidth measured in the same run), the FP8 / bf16 ratio with
LoRA, and the LoRA's share. Peer figures: vLLM 0.33.0's deployed LoRA op (w13 + w2, bench/anchors) where its shape
and T are the same (qwen3-30b-a3b = qwen3moe, mixtral-8x7b = mixtral, gpt-oss-20b = gptoss20b at 1, 16, 128,
1024, 4096 tokens): our LoRA's share (ms_lora - ms_base) sits beside it. Correctness is check's job (the FP8 rows
and suites/experts/test_fp8_triton.py); here `rel_vs_bf16` says how far the FP8 output lies from bf16's, for
information only.

  python bench/bench_fp8.py --out fp8.json --md fp8.md [--models NAME,...] [--T 1,64,1024,4096] [--budget-s 300]
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_experts import markdown_table, time_graph  # noqa: E402

SCHEMES = ("none", "fp8_w8a8", "fp8_block")
T_DEFAULT = (1, 16, 128, 1024, 4096)
ANCHOR_NAMES = {"qwen3-30b-a3b": "qwen3moe", "mixtral-8x7b": "mixtral", "gpt-oss-20b": "gptoss20b"}
ANCHORS = pathlib.Path(__file__).resolve().parent / "anchors" / "vllm-0.33.0-deployed-h200.json"


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read plus written), median of do_bench."""
    import triton
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def peer_lora_us(anchors: list, model: str, T: int, rank: int) -> float | None:
    """vLLM's deployed w13 + w2 LoRA op time (us) for the anchor's shape, when it has both."""
    name = ANCHOR_NAMES.get(model)
    rows = [a for a in anchors if a["model"] == name and a["T"] == T and a["R"] == rank]
    parts = {a["which"]: a["vllm_deployed_us"] for a in rows}
    return parts["w13"] + parts["w2"] if {"w13", "w2"} <= parts.keys() else None


def build_layer(layer, seed: int = 0) -> dict:
    """Random bf16 weights of one model's layer on the GPU (one expert at a time), and their FP8 forms (lazily)."""
    from moe_lora_harness.kernels.experts.config import is_gated_activation
    H, I, E = layer.H, layer.I, layer.E
    N1 = 2 * I if is_gated_activation(layer.activation) else I
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.empty(E, N1, H, device="cuda", dtype=torch.bfloat16)
    w2 = torch.empty(E, H, I, device="cuda", dtype=torch.bfloat16)
    for e in range(E):
        w13[e] = (torch.randn(N1, H, device="cuda", generator=g) / math.sqrt(H)).to(torch.bfloat16)
        w2[e] = (torch.randn(H, I, device="cuda", generator=g) / math.sqrt(I)).to(torch.bfloat16)
    bias = None
    if layer.bias:
        bias = (torch.randn(E, N1, device="cuda", generator=g).to(torch.bfloat16) / 8,
                torch.randn(E, H, device="cuda", generator=g).to(torch.bfloat16) / 8)
    return dict(layer=layer, N1=N1, w13=w13, w2=w2, bias=bias, fp8={})


def weights_for(lw: dict, scheme: str):
    """(w13, w2) as the experts take them: the bf16 tensors, or QuantWeights of the scheme (reference quantizer)."""
    if scheme == "none":
        return lw["w13"], lw["w2"]
    if scheme not in lw["fp8"]:
        from moe_lora_harness.kernels.triton.quant_gemm import pack_weights
        from moe_lora_harness.reference.fp8 import quantize_weights
        lw["fp8"].clear()                      # one FP8 form at a time (DeepSeek-V3's w13 alone is 7.5 GB in e4m3)
        torch.cuda.empty_cache()
        lw["fp8"][scheme] = tuple(pack_weights(*quantize_weights(w, scheme), scheme) for w in (lw["w13"], lw["w2"]))
    return lw["fp8"][scheme]


def batch(lw: dict, T: int, rank: int, loras: int, seed: int = 1) -> dict:
    """x, routing (top-k of random scores, softmax weights) and a LoRA context of `loras` rank-`rank` slots."""
    from moe_lora_harness.kernels.experts.lora_context import MoELoRAContext
    layer = lw["layer"]
    H, I, E, k = layer.H, layer.I, layer.E, layer.top_k
    g = torch.Generator(device="cuda").manual_seed(seed + T)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    scores = torch.rand(T, E, device="cuda", generator=g)
    tw, topk = torch.topk(scores, k, dim=1)
    tw = torch.softmax(tw, dim=1)

    def rnd(*shape, fan_in):
        return (torch.randn(*shape, device="cuda", generator=g) / math.sqrt(fan_in)).to(torch.bfloat16)
    slices = 2 if lw["N1"] == 2 * I else 1
    ctx = MoELoRAContext(
        w13_lora_a_stacked=[rnd(loras, E, rank, H, fan_in=H) for _ in range(slices)],
        w13_lora_b_stacked=[rnd(loras, E, I, rank, fan_in=rank) for _ in range(slices)],
        w2_lora_a_stacked=[rnd(loras, E, rank, I, fan_in=I)], w2_lora_b_stacked=[rnd(loras, E, H, rank, fan_in=rank)],
        adapter_enabled=torch.ones(loras + 1, dtype=torch.int32, device="cuda"), max_loras=loras, top_k=k,
        w13_num_slices=slices, local_num_experts=E,
        token_lora_mapping=torch.randint(0, loras, (T,), device="cuda", dtype=torch.int32, generator=g))
    return dict(x=x, tw=tw, topk=topk.to(torch.int32), ctx=ctx, touched=int(torch.unique(topk).numel()))


def forward(lw: dict, scheme: str, b: dict, lora: bool, rank: int):
    """(fn, out): TritonExperts through FusedMoEKernel for the scheme, with or without the LoRA context."""
    from moe_lora_harness.kernels.experts.config import MoEConfig
    from moe_lora_harness.kernels.experts.modular import FusedMoEKernel
    from moe_lora_harness.kernels.experts.prepare_finalize import NoEPPrepareAndFinalize
    from moe_lora_harness.kernels.experts.triton_experts import TritonExperts
    layer = lw["layer"]
    cfg = MoEConfig("cuda", torch.bfloat16, layer.activation, layer.H, layer.I, layer.E, layer.top_k,
                    has_bias=layer.bias, quant=scheme, lora_enabled=lora, max_lora_rank=rank if lora else 0)
    ok, why = TritonExperts.is_supported_config(cfg)
    if not ok:
        return why, None
    kernel = FusedMoEKernel(NoEPPrepareAndFinalize(), TritonExperts(cfg))
    w13, w2 = weights_for(lw, scheme)
    bias = lw["bias"] or (None, None)
    out = torch.empty(b["x"].shape, device="cuda", dtype=torch.bfloat16)

    def fn():
        kernel.apply(b["x"], w13, w2, b["tw"], b["topk"], lora_ctx=b["ctx"] if lora else None, output=out,
                     w13_bias=bias[0], w2_bias=bias[1])
    return fn, out


def floor_ms(lw: dict, scheme: str, b: dict, bw: float) -> float:
    """The fewest bytes a forward moves: each touched expert's w13 and w2 once at the scheme's width, x, output."""
    layer = lw["layer"]
    width = 2 if scheme == "none" else 1
    weights = b["touched"] * (lw["N1"] * layer.H + layer.H * layer.I) * width
    return (weights + 2 * b["x"].numel() * 2) / bw * 1e3


def rows_for(models, Ts, rank: int, loras: int, deadline: float, bw: float, anchors: list) -> list:
    """One row per (model, T, scheme): ms without and with LoRA, the floor, the ratio to bf16 with LoRA."""
    from moe_lora_harness.harness.served.models import model_named
    rows = []
    for name in models:
        layer = model_named(name)
        lw = build_layer(layer)
        for T in Ts:
            b = batch(lw, T, rank, loras)
            base = {}
            for scheme in SCHEMES:
                row = dict(model=name, T=T, scheme=scheme, H=layer.H, I=layer.I, E=layer.E, top_k=layer.top_k)
                if time.time() > deadline:
                    rows.append(dict(row, skipped="budget"))
                    continue
                try:
                    fn0, _ = forward(lw, scheme, b, False, rank)
                    fn1, out1 = forward(lw, scheme, b, True, rank)
                    if out1 is None:
                        rows.append(dict(row, skipped=fn1))
                        continue
                    fn1()
                    torch.cuda.synchronize()
                    if scheme == "none":
                        base["out"] = out1.float()
                    elif "out" in base:
                        ref = base["out"]
                        row["rel_vs_bf16"] = float((out1.float() - ref).norm() / ref.norm().clamp_min(1e-30))
                    row.update(ms_base=time_graph(fn0), ms_lora=time_graph(fn1), floor_ms=floor_ms(lw, scheme, b, bw))
                    row["lora_share"] = (row["ms_lora"] - row["ms_base"]) / row["ms_lora"]
                    if scheme == "none":
                        base["ms_lora"] = row["ms_lora"]
                    elif "ms_lora" in base:
                        row["vs_bf16_lora"] = row["ms_lora"] / base["ms_lora"]
                    peer = peer_lora_us(anchors, name, T, rank)
                    if peer is not None:
                        row["ours_lora_us"] = (row["ms_lora"] - row["ms_base"]) * 1e3
                        row["vllm_lora_op_us"] = peer
                except Exception as exc:  # noqa: BLE001 - a failing row is reported, the sweep goes on
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(row)
                print(json.dumps(row), flush=True)
            del b
        del lw
        torch.cuda.empty_cache()
    return rows


COLUMNS = ["model", "T", "scheme", "ms_base", "ms_lora", "floor_ms", "vs_bf16_lora", "lora_share", "ours_lora_us",
           "vllm_lora_op_us", "rel_vs_bf16", "skipped", "error"]


def main(argv=None) -> int:
    from moe_lora_harness.harness.served.models import MODELS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(m.name for m in MODELS))
    p.add_argument("--T", default=",".join(map(str, T_DEFAULT)))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--loras", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=600.0, help="stop starting new rows after this many seconds")
    p.add_argument("--out", default=None)
    p.add_argument("--md", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8: needs a CUDA GPU (FP8 tensor cores)", file=sys.stderr)
        return 2
    anchors = json.loads(ANCHORS.read_text()) if ANCHORS.exists() else []
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = rows_for(a.models.split(","), [int(t) for t in a.T.split(",")], a.rank, a.loras,
                    time.time() + a.budget_s, bw, anchors)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_tb_s=bw / 1e12, rank=a.rank,
                loras=a.loras)
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    if a.md:
        pathlib.Path(a.md).write_text(markdown_table(rows, COLUMNS))
    return 0 if not any("error" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
