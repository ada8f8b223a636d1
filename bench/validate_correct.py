"""Correct backends on random cases through the runner, counting verdicts: the no-false-verdict check every twin or
rule change needs (the twin and its measures run where the runner runs them). One preset per region of cases the
judge treats apart (PRESETS: fp32 unless `--dtype` says otherwise); levels (MAKERS) expert (one rank, decode calls, TP, dispatched EP), op (every flag) and
fp8_decode (FP8 decode calls pooled, its own sizes).

    python bench/validate_correct.py REF|NAME [--preset served|few_rows|short_sums|columns]
                                     [--level expert|op|fp8_decode] [--dtype float32|float16|bfloat16|any]
                                     [--quant none|int4_g128|int8_channel] [--big]
                                     [--device cpu|cuda] [--seconds 60] [--cases 3000] [--seed 0]

One line of counts (and how many cases ran a twin), then up to eight failures with their cases. A GPU draws served
sizes too (`--big`: on any device). Replaces the per-session scripts under bench/results
(2026-12-06-cpu-s46/twin_rule3_validation.py, 2026-12-07-cpu-s47/small_rows_validation.py, short_sums_validation.py;
2026-12-07-cpu-s52/fp8_pooled_validation.py, whose draws fp8_decode_case kept until it pooled more rows)."""
from __future__ import annotations

import argparse
import random
import sys
import time

from moe_lora_harness.harness.execution.execute import InProcess
from moe_lora_harness.harness.execution.runner import run_case
from moe_lora_harness.harness.judge.expectation import declared_rounding, twin_applies
from moe_lora_harness.harness.spec.case import FP16_MASSIVE_MAGNITUDE, MAPPINGS, MASSIVE_OUTLIER_SCALE, Case
from moe_lora_harness.harness.spec.contract import support_for
from moe_lora_harness.harness.spec.registry import available_backends, load_ref

ACTS = ["silu", "silu", "gelu", "swigluoai", "relu2_no_mul", "silu_no_mul"]


def _served(rng, big):
    """Rows on both sides of rule 4's 83, H and I of 64-256 (a GPU: to 4096 and 1536), ranks 4-64."""
    rows = rng.choice([rng.randint(83, 300), rng.randint(83, 140), rng.randint(2, 82)]
                      + ([rng.randint(300, 2048)] if big else []))
    return (rows, rng.choice([64, 128, 192, 256] + ([1024, 2048, 4096] if big else [])),
            rng.choice([64, 96, 128, 192] + ([768, 1536] if big else [])), rng.choice([4, 8, 16, 32, 64]))


def _few_rows(rng, big):
    """1-82 rows of 512 elements or more (the twin below rule 4's rows)."""
    return (rng.choice([1, 1, rng.randint(2, 8), rng.randint(9, 82)]),
            rng.choice([512, 768, 1024] + ([2048, 4096, 7168] if big else [2048])),
            rng.choice([64, 128, 192, 256] + ([768, 1536] if big else [])), rng.choice([4, 8, 16, 32, 64]))


def _short_sums(rng, big):
    """83-300 rows, sums of 1-160 terms and ranks 1-16 (short sums round alike; few sources)."""
    dim = lambda: rng.choice([rng.randint(1, 8), rng.randint(9, 40), rng.randint(64, 160)])  # noqa: E731
    return rng.randint(83, 300), dim(), dim(), rng.choice([1, 2, 3, 4, 16])


def _columns(rng, big):
    """115-400 rows (rule 4's column blocks run: every row set over their threshold's square), widths 64-7168 aligned
    and not (the last block of each size cut at the row's end; the narrowest block widens past 1024), ranks 4-64
    (the CPU: to 260 rows, widths to 512)."""
    return (rng.randint(115, 400 if big else 260),
            rng.choice([64, 100, 128, 200, 256, 333] + ([1024, 2048, 2880, 4096, 7168] if big else [512])),
            rng.choice([64, 96, 128, 200] + ([768, 1536] if big else [])), rng.choice([4, 8, 16, 32, 64]))


# name -> draw(rng, big) -> (T, H, I, max_rank)
PRESETS = {"served": _served, "few_rows": _few_rows, "short_sums": _short_sums, "columns": _columns}
DTYPES = ("float32", "float16", "bfloat16")


def op_case(rng, draw, big, dtype, quant="none") -> Case:
    T, H, I, R = draw(rng, big)
    E, ep, slices, fs = rng.choice([4, 8, 16]), rng.choice([1, 1, 1, 2]), rng.choice([1, 2, 3]), rng.random() < 0.2
    return Case(level="op", T=T, H=H, I=I, E=E, top_k=min(rng.choice([1, 2, 4]), E), dtype=dtype(),
                max_loras=rng.choice([1, 2, 4]), max_rank=R, mapping=rng.choice(MAPPINGS),
                which=rng.choice(["w13", "w2"]), num_slices=slices, mul_routed_weight=rng.random() < 0.3,
                add_inputs=fs or rng.random() < 0.7, layout=rng.choice(["sorted", "sorted", "naive"]),
                block_size_m=rng.choice([16, 32, 64]), fully_sharded=fs, shared_a=rng.random() < 0.15,
                shared_b=rng.random() < 0.15, ep_size=ep, ep_rank=rng.randrange(ep),
                magnitude=rng.choice([1.0, 1.0, 2.0 ** -6, 64.0]), seed=rng.randint(0, 10 ** 6))


def expert_case(rng, draw, big, dtype, quant="none") -> Case:
    T, H, I, R = draw(rng, big)
    E = rng.choice([4, 8, 16])
    kw = dict(level="expert", T=T, H=H, I=I, E=E, top_k=min(rng.choice([1, 2, 4]), E), dtype=dtype(),
              max_loras=rng.choice([1, 2, 4]), max_rank=R, mapping=rng.choice(MAPPINGS),
              activation=rng.choice(ACTS), bias=rng.random() < 0.3, shared_a=rng.random() < 0.15,
              shared_b=rng.random() < 0.15, magnitude=rng.choice([1.0, 1.0, 2.0 ** -6, 64.0]),
              lora=rng.random() < 0.9, seed=rng.randint(0, 10 ** 6), quant=quant)
    u = rng.random()
    if u < 0.3:
        kw.update(tp_size=rng.choice([2, 2, 4]), fully_sharded=rng.random() < 0.5)
    elif u < 0.45:
        ep = rng.choice([2, 2, 4])
        cuts = sorted(rng.randint(0, T) for _ in range(ep - 1))
        kw.update(ep_size=ep, ep_tokens=tuple(b - a for a, b in zip([0, *cuts], [*cuts, T])))
    elif u < 0.6:
        ct = rng.choice([1, 2, 4, 8])
        kw.update(T=max(T // ct, 1) * ct, call_tokens=ct)
    return Case(**kw)


def fp8_decode_case(rng, draw, big, dtype, quant="none") -> Case:
    """FP8 activations handed over in decode calls of 1-16 tokens and judged pooled (83-360 rows; to 200 until the
    fifty-fifth session, when rule 4's column blocks, past 115 rows, came into reach), as check --model
    judges an FP8 row's decode token counts: both schemes, fp16 and bf16, half with a massive-activation token. Its
    own sizes (H and I multiples of 128, as the block scheme needs), dtypes and schemes: `draw`, `dtype` and `quant`
    are not used."""
    per_call = rng.choice([1, 2, 3, 4, 7, 8, 16])
    calls = -(-rng.randint(83, 360) // per_call)
    dtype = rng.choice(["float16", "bfloat16"])
    kw = dict(outliers=1, outlier_scale=MASSIVE_OUTLIER_SCALE) if rng.random() < 0.5 else {}
    if kw and dtype == "float16":
        kw["magnitude"] = FP16_MASSIVE_MAGNITUDE
    E = rng.choice([4, 8, 16])
    return Case(level="expert", T=per_call * calls, call_tokens=per_call, H=rng.choice([128, 256, 384]),
                I=rng.choice([128, 256]), E=E, top_k=min(rng.choice([1, 2, 4]), E), max_loras=rng.choice([1, 2, 4]),
                max_rank=rng.choice([4, 8, 16]), dtype=dtype, seed=rng.randint(0, 10 ** 6),
                quant=rng.choice(["fp8_w8a8", "fp8_block"]), mapping=rng.choice(["uniform", "mixed"]),
                activation=rng.choice(["silu", "gelu", "swigluoai", "relu2_no_mul"]), lora=rng.random() < 0.8, **kw)


# --level -> make(rng, draw, big, dtype, quant) -> Case (dtype() draws the case's dtype; quant: the expert level's)
MAKERS = {"op": op_case, "expert": expert_case, "fp8_decode": fp8_decode_case}


def validate(spec, level: str, preset: str, device: str, seconds: float, cases: int, seed: int,
             dtype: str = "float32", quant: str = "none", big: bool = False) -> list:
    """Run `spec` on random cases of `preset` in `dtype` ("any": each case draws one), expert cases with weights
    `quant` (weight-only schemes), until `cases` or `seconds`; print the counts; return the failures. Cases the
    draw makes invalid (int4_g128 needs H and I multiples of 128) are drawn again, not counted."""
    rng, draw, big = random.Random(seed), PRESETS[preset], big or not device.startswith("cpu")
    make = MAKERS[level]
    pick = (lambda: rng.choice(DTYPES)) if dtype == "any" else (lambda: dtype)
    t0, counts, fails, twins, i = time.time(), {}, [], 0, 0
    while i < cases and time.time() - t0 < seconds:
        case = make(rng, draw, big, pick, quant)
        if case.problems():
            continue
        i += 1
        if support_for(spec, case, device)[0]:     # the runner's own question (FP8: the device and declarations)
            _, points_only, mma = declared_rounding(spec, case, device)
            twins += twin_applies(case, device, mma, points_only)
        o = run_case(spec, case, device, executor=InProcess(), reruns=0)
        key = f"xfail:{o.kind}" if o.status == "xfail" else o.status     # what the ledger's entry was given
        counts[key] = counts.get(key, 0) + 1
        if o.status not in ("pass", "unsupported", "xfail", "not-runnable"):
            fails.append((case.to_json(), o.status, (o.message or o.reason or "")[:400]))
    print(spec.name, device, level, preset, dtype, quant, "cases", i, "twinned", twins, counts,
          "%.0fs" % (time.time() - t0), flush=True)
    for f in fails[:8]:
        print("FAIL", f, flush=True)
    return fails


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ref", help="a registered backend's name, or MODULE:ATTR / path.py:ATTR")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="served")
    ap.add_argument("--level", choices=sorted(MAKERS), default="expert")
    ap.add_argument("--dtype", choices=[*DTYPES, "any"], default="float32")
    ap.add_argument("--quant", choices=["none", "int4_g128", "int8_channel"], default="none",
                    help="expert level: weight-only quantized weights")
    ap.add_argument("--big", action="store_true", help="draw the GPU's sizes on any device")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--cases", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.quant != "none" and a.level != "expert":
        ap.error(f"--quant {a.quant} is an expert-level setting (--level expert), got --level {a.level}")
    specs = load_ref(a.ref) if ":" in a.ref else [available_backends()[a.ref]]
    failed = [validate(s, a.level, a.preset, a.device, a.seconds, a.cases, a.seed, a.dtype, a.quant, a.big)
              for s in specs]
    return 1 if any(failed) else 0


if __name__ == "__main__":
    sys.exit(main())
