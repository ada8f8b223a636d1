"""Launch heuristics of the three op paths, pinned: a change to one path's rule must not move another's.

The configs each heuristic picks on an H200 (132 SMs) for the benchmark shapes are recorded in
`data/launch_configs_h200.json`. A deliberate heuristic change regenerates it
(`python suites/kernels/test_launch_heuristics.py --update`) and the diff shows which shapes moved; an
accidental one (the second session's one-shot refit leaked into the two-kernel and small-batch rules and
made them up to 40% slower on the GPU) fails here, on the CPU, before any GPU run.
"""
from __future__ import annotations

import json
import pathlib
import sys
import types

import pytest
import torch

from moe_lora_harness.kernels.triton import one_shot, small_batch, two_kernel
from moe_lora_harness.kernels.triton.platform import DeviceInfo

GOLDEN = pathlib.Path(__file__).with_name("data") / "launch_configs_h200.json"
H200 = DeviceInfo(sm_count=132, max_shared_mem=232448, capability=(9, 0), interpreted=False)
MODELS = {"qwen3moe": (2048, 768, 128, 8), "mixtral": (4096, 14336, 8, 2), "gptoss20b": (2880, 2880, 32, 4)}
RANKS = (16, 64, 128)
TOKENS = (1, 16, 128, 1024, 4096)


def fake_call(model: str, which: str, R: int, T: int, naive: bool, dtype=torch.bfloat16):
    """The OpCall fields the heuristics read, for one benchmark shape (4 LoRA slots + the -1 slot)."""
    H, I, E, k = MODELS[model]
    S, K, N, mul = (2, H, I, False) if which == "w13" else (1, I, H, True)
    return types.SimpleNamespace(
        output=torch.empty(1, 1, 1, dtype=dtype), naive=naive, num_pairs=T * k, num_experts=E, max_loras=4,
        num_active=5, rank=R, hidden=K, n_out=N, num_slices=S, block_m=64, add_inputs=True,
        mul_routed_weight=mul, top_k=k, num_tokens=T, experts_a=E, experts_b=E)


def current_configs() -> dict:
    """shape key -> {path: repr of the config the heuristic picks} on the H200."""
    saved = {m: m.device_info for m in (one_shot, small_batch)}
    try:
        for m in saved:
            m.device_info = lambda _dev: H200
        out = {}
        for model in MODELS:
            for which in ("w13", "w2"):
                for R in RANKS:
                    for T in TOKENS:
                        for naive in (False, True):
                            c = fake_call(model, which, R, T, naive)
                            key = f"{model}:{which}:R{R}:T{T}:{'naive' if naive else 'sorted'}"
                            out[key] = {"one_shot": repr(one_shot.choose_config(c)),
                                        "two_kernel_sub_m": two_kernel.choose_sub_m(c)}
                            if naive and R <= 64 and T * c.top_k * R <= 1024:
                                out[key]["small_batch"] = repr(small_batch.choose_config(c))
                            if not naive and T >= 1024:
                                out[key]["one_shot_fp32"] = repr(one_shot.choose_config(
                                    fake_call(model, which, R, T, naive, torch.float32)))
        return out
    finally:
        for m, f in saved.items():
            m.device_info = f


def test_launch_configs_match_the_recorded_ones():
    want = json.loads(GOLDEN.read_text())
    got = current_configs()
    assert got.keys() == want.keys()
    moved = [(key, path) for key in want for path in sorted(set(want[key]) | set(got[key]))
             if want[key].get(path) != got[key].get(path)]
    paths = sorted({path for _, path in moved})
    diffs = [f"{key} {path}: {want[key].get(path)} -> {got[key].get(path)}" for key, path in moved]
    assert not diffs, (f"launch configs moved for paths {paths} ({len(diffs)} shapes); if deliberate, run "
                       f"`python -m moe_lora_harness.suites.kernels.test_launch_heuristics --update`:\n" + "\n".join(diffs[:20]))


@pytest.mark.parametrize("T", TOKENS)
def test_expand_pipeline_and_register_cap_rules(T):
    """Sorted layouts get the 3-deep expand pipeline; the naive layout keeps the compiler defaults; the
    bf16-fit register cap goes to rank <= 32 tiles only, never to fp32 tiles or two-slice 64-row tiles."""
    configs = current_configs()
    for key, cfgs in configs.items():
        if f":T{T}:" not in key:
            continue
        cfg = cfgs["one_shot"]
        assert "maxnreg=0" in cfgs.get("one_shot_fp32", "maxnreg=0"), key  # recorded at T >= 1024, sorted
        if key.endswith("naive"):
            assert "expand_stages=0" in cfg and "maxnreg=0" in cfg, key
            continue
        assert "expand_stages=3" in cfg, key
        capped = "maxnreg=168" in cfg
        rank = int(key.split(":R")[1].split(":")[0])
        two_wide = "two_slices=True" in cfg and "sub_m=64" in cfg
        assert capped == (rank <= 32 and not two_wide and "num_warps=4" in cfg), key
        assert capped or "maxnreg=0" in cfg, key


if __name__ == "__main__":
    if sys.argv[1:] == ["--update"]:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(current_configs(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {GOLDEN}")
    else:
        print(__doc__)
