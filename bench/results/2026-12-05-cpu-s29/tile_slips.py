"""A kernel accumulating its GEMMs in the working dtype per K tile (acc tile kept in bf16/fp16): judged as one_shot."""
import sys, torch, dataclasses
import moe_lora_harness.reference.precision as P
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.build.expert_runner import expert_expectations
from moe_lora_harness.harness.judge.expectation import Rules, judge_output, row_groups
from moe_lora_harness.harness.selftest.power import _oracle_fails
H, I, T = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
TILE = None
orig_mm = P.Precision.mm
def tiled_mm(self, x, w):
    if TILE is None or self.dtype is None:
        return orig_mm(self, x, w)
    acc = None
    for k0 in range(0, x.shape[-1], TILE):
        part = x[..., k0:k0 + TILE] @ w[..., k0:k0 + TILE].transpose(-1, -2)
        acc = part if acc is None else acc + part
        acc = P.rnd(acc, self.dtype)
    return acc
P.Precision.mm = tiled_mm
P.Precision.plain_gemm = property(lambda self: TILE is None or self.dtype is None)
for dt in sys.argv[4].split(","):
    case = Case(level="expert", T=T, dtype=dt, max_rank=64, seed=1, H=H, I=I, E=8, top_k=2, activation="silu", bias=False)
    TILE = None
    inp, truth, emu = expert_expectations(case, "one_shot")
    err0 = float((emu.value - truth.value).norm())
    for tile in (int(t) for t in sys.argv[5].split(",")):
        TILE = tile
        _, _, e2 = expert_expectations(case, "one_shot", emulation_only=True, inputs=inp)
        TILE = None
        out = e2.value.to(getattr(torch, dt))
        size = float((out.double() - emu.value).norm()) / err0
        for pts in (False, True):
            rules = Rules("cpu", pts, row_groups(inp, truth))
            v = judge_output(case, out, truth, emu.value, "one_shot", rules)
            print(f"{dt} tile {tile:4d} {'points' if pts else 'default'} slip/own {size:6.3f} judge {'pass' if v.ok else 'FAIL'} ratio {v.ratio:.3g} exc {v.excess:.3g} ulps {v.max_ulps:.3g} oracle {'FAIL' if _oracle_fails(out, truth.value) else 'pass'} {v.kind}")
