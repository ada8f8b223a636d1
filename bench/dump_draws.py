"""Dump what a refactor of the harness must keep, as JSON, to compare before and after a change:

  python bench/dump_draws.py before.json   (at the old commit)   ...   python bench/dump_draws.py after.json
  python -c "import json,sys; a,b=(json.load(open(p)) for p in sys.argv[1:]); print([k for k in a if a[k]!=b.get(k)])" before.json after.json

Derandomized strategy draws (every builtin backend and level on the CPU, free and classed; the classed draws on
a GPU; the default strategies with and without palettes), the pairwise designs and their cases on both size
profiles, every palette, every feature's cases on cpu and cuda, the signature axes and their plain flips of a few
hundred cases, and the pool of integer literals hypothesis draws local constants from (it changes the draws:
docs/architecture.md, "The axis and profile tables"). No kernel runs. About 4 minutes on 2 CPU cores.
"""
from __future__ import annotations

import json
import sys

from hypothesis.errors import Unsatisfiable
from hypothesis.internal.conjecture.providers import _get_local_constants

from moe_lora_harness.harness.draw import compile_classes as CC
from moe_lora_harness.harness.draw import covering as C
from moe_lora_harness.harness.check import features as F
from moe_lora_harness.harness.draw import profiles as P
from moe_lora_harness.harness.draw import strategies as S
from moe_lora_harness.harness.draw.axes import AXES
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.registry import available_backends
from moe_lora_harness.harness.search.signatures import PLAIN, axes_of


def _draws(strategy, n: int, seed: int = 0):
    try:
        return [c.to_json() for c in S.examples(strategy, n, seed=seed)]
    except Unsatisfiable:
        return "unsatisfiable"


def _palette(p) -> dict:
    return {"axes": [(a.name, list(map(str, a.values))) for a in p.axes],
            "classes": [[list(c.labels), sorted(c.fields.items()), list(c.tokens)] for c in p.classes],
            "unmet": [list(map(list, u)) for u in p.unmet]}


def dump(n: int = 300) -> dict:
    out: dict = {}
    backends = available_backends()
    selftest, gpu = P.selftest_draw_sizes("cpu"), P.draw_sizes("cuda", "op")
    for name, spec in backends.items():
        levels = [lv for lv in ("op", "expert") if lv in spec.capabilities.levels]
        levels += ["ep"] if "expert" in levels and spec.capabilities.expert_parallel else []
        for lv in levels:
            cpu = P.draw_sizes("cpu", lv)
            out[f"claimed/{name}/{lv}/cpu"] = _draws(S.claimed_cases(spec, "cpu", lv, **cpu), n)
            out[f"claimed/{name}/{lv}/cpu/selftest"] = _draws(S.claimed_cases(spec, "cpu", lv, **selftest), n // 3)
            out[f"claimed/{name}/{lv}/cpu/classes"] = _draws(
                S.claimed_cases(spec, "cpu", lv, compile_classes=True, **cpu), n // 2)
            out[f"claimed/{name}/{lv}/cuda/classes"] = _draws(
                S.claimed_cases(spec, "cuda", lv, compile_classes=True, **gpu), n // 2)
        for lv in ("op", "expert"):
            if lv in spec.capabilities.levels:
                for dev, sz in (("cpu", P.draw_sizes("cpu", lv)), ("cpu", selftest), ("cuda", gpu)):
                    out[f"palette/{name}/{lv}/{dev}/{sz['max_T']}/{sz['max_dim']}"] = _palette(
                        CC.palette_for(spec, dev, lv, **sz))
    for seed in (0, 3):
        for strategy in (S.op_cases, S.expert_cases, S.ep_cases):
            out[f"{strategy.__name__}/default/{seed}"] = _draws(strategy(), n, seed)
    for lv in ("op", "expert"):
        d = C.design(lv)
        out[f"design/{lv}/rows"] = [list(r.items()) for r in d.rows]
        out[f"design/{lv}/excluded"] = sorted([list(map(list, k)), v] for k, v in d.excluded.items())
        for prof in (P.SMALL, P.LARGE):
            out[f"design/{lv}/{prof.small}/cases"] = [Case(**dict(d.fields(i, prof), seed=0)).to_json()
                                                      for i in range(len(d.rows))]
    for dev in ("cpu", "cuda"):
        out[f"features/{dev}"] = [[f.name, i, c.to_json()] for f, i, c in F.feature_cases(F.FEATURES, dev, 6)]
    probe = [Case.from_json(j) for k in ("op_cases/default/0", "expert_cases/default/0", "ep_cases/default/0")
             for j in out[k][: n // 2]]
    out["axes"] = [[c.to_json(), sorted(axes_of(c).items()),
                    {a: AXES[a].plain(c).to_json() for a in sorted(axes_of(c)) if AXES[a].plain is not None}]
                   for c in probe]
    out["plain"] = {lv: sorted(p.items()) for lv, p in PLAIN.items()}
    out["local_constant_integers"] = sorted(_get_local_constants().integers)
    return out


if __name__ == "__main__":
    json.dump(dump(), open(sys.argv[1], "w"), indent=0, sort_keys=True)
