"""A study, not a rule: how tight could a per-element bound be that knows how rarely a rounding flips?

For the CPU power case (`selftest --power`'s default: eager, H 1024, I 512, E 8, top-2, rank 64, 2 slots; bf16 or
fp16, the one_shot rounding points) this recomputes the emulation step by step (checked bit for bit against the
reference's), and at every rounding point takes the exact value's distance `d` to the nearest rounding boundary. A
kernel that rounds only where the model rounds leaves a point's value where the emulation put it unless its own
fp32 error plus the flips reaching it from upstream cross that boundary. A point whose deviation may pass the
boundary beyond the nearest (probability over P_MIN, about 1e-15: the union over every point of the case must stay
under 1e-9) passes its upstream through with one spacing more, as the present model takes every rounding; the
output's per-element bound is the smallest number of spacings its deviation cannot pass with probability
1 - 1e-9 / n. Two models of a point's flip probability (`--model`):
  bennett   Bennett's inequality from the upstream flips' variance, mean, largest term and summed sizes (the
            moments a rule could carry per value), every flip independent;
  chernoff  each flip its own term (probability, size) in Chernoff's bound, carried as the moments
            sum_j p_j |J_ij|^m b_j^m (each one GEMM of the weights' m-th powers); a rank intermediate's flips reach
            every column of its pair, so they are taken at their worst (a shift), which is what makes the bound
            valid; STUDY_OPTIMISTIC=1 takes them as independent terms instead (not valid: shows what sharing costs).
Printed beside what a correct kernel (eager) does, rule 2's present bound and assert_close(2e-2). Measured
(thirty-second session, bf16): bennett 49 spacings at the median against rule 2's 23; chernoff over 200; see
bench/results/2026-12-05-cpu-s32/. docs/error-model.md, "Where the power table stands".

    python bench/flip_bound_study.py [--dtype bfloat16] [--tokens 256] [--model bennett|chernoff]
"""
from __future__ import annotations

import argparse
import math
import os

import torch

from moe_lora_harness.backends import BUILTINS
from moe_lora_harness.harness.judge import compare
from moe_lora_harness.harness.selftest import power
from moe_lora_harness.reference.accumulation import ACT_ULPS, U32
from moe_lora_harness.reference.precision import rnd

F64 = torch.float64
# flips less likely than this are left out of the sums (their total is reported)
P_MIN = float(os.environ.get("STUDY_P_MIN", "1e-15"))


class Point:
    """One rounding point: exact pre-values y, rounded values v, spacing s, distance to the boundary d."""

    def __init__(self, y: torch.Tensor, dt: torch.dtype):
        self.y = y
        self.v = rnd(y, dt)                                 # one rounding (a cast through fp32 rounds twice)
        mant = -round(math.log2(torch.finfo(dt).eps))
        a = self.v.abs().clamp_min(torch.finfo(dt).tiny)
        e = torch.floor(torch.log2(a))
        self.s = torch.exp2(e - mant)
        pow2 = a == torch.exp2(e)
        s_in = torch.where(pow2, self.s / 2, self.s)       # the spacing toward zero halves at a power of two
        off = self.y.abs() - a                              # |y| - |v|: > 0 away from zero
        self.d = torch.where(off >= 0, self.s / 2 - off, s_in / 2 + off).clamp_min(0)


def _bennett(t, var, big):
    """P(|S| >= t) for a sum of independent centred terms, each at most `big`, of variance `var` in all (Bennett:
    2 exp(-(var / big^2) h(big t / var)), h(u) = (1 + u) ln(1 + u) - u); 1 where t <= 0."""
    v = var.clamp_min(1e-300)
    b = big.clamp_min(1e-300)
    u = b * t / v
    h = (1 + u) * torch.log1p(u) - u
    p = (2 * torch.exp(-(v / (b * b)) * h)).clamp(max=1.0)
    p = torch.where((var <= 0) | (big <= 0), (t <= 0).to(F64), p)
    return torch.where(t <= 0, torch.ones_like(p), p)


SPLITS = (0.0, 0.25, 0.5, 0.7, 0.85, 0.95, 1.0)


def split_tail(t, v, terms_tail, at_zero):
    """P(|G + S| >= t), G Gaussian of variance v (the fp32 errors) and S the flip terms: the smallest over splits
    t = (1 - a) t + a t of P(|G| >= (1 - a) t) + P(|S| >= a t), the latter `terms_tail(a t)` (`at_zero` where a is
    0); 1 where t <= 0."""
    best = torch.ones_like(t)
    for a_ in SPLITS:
        tg = (1 - a_) * t
        pg = torch.where(v > 0, (2 * torch.exp(-tg.clamp_min(0) ** 2 / (2 * v.clamp_min(1e-300)))).clamp(max=1.0),
                         (tg <= 0).to(F64))
        ps = at_zero if a_ == 0 else terms_tail(a_ * t)
        best = torch.minimum(best, (pg + ps).clamp(max=1.0))
    return torch.where(t <= 0, torch.ones_like(best), best)


class Dev:
    """Bennett's model: a value's deviation from the emulation as independent terms, carried as their variance, the
    sum of their means' sizes, the largest term and the terms' sizes summed (a hard cap)."""

    def __init__(self, var, mean, big, l1):
        self.var, self.mean, self.big, self.l1 = var, mean, big, l1

    @staticmethod
    def zero(like):
        z = torch.zeros_like(like)
        return Dev(z, z, z, z)

    def scaled(self, j):
        """Through an elementwise factor j."""
        return Dev(j * j * self.var, j.abs() * self.mean, j.abs() * self.big, j.abs() * self.l1)

    def __add__(self, o):
        return Dev(self.var + o.var, self.mean + o.mean, torch.maximum(self.big, o.big), self.l1 + o.l1)

    def through(self, M: torch.Tensor) -> "Dev":
        """Through a batched matrix-vector product out[p] = M[p] @ x[p] (M (P, N, K))."""
        return Dev(_bmv(M * M, self.var), _bmv(M.abs(), self.mean), _max_bmv(M, self.big), _bmv(M.abs(), self.l1))

    def pooled(self, T, k):
        """moe_sum: the k pairs of each token added (independent terms)."""
        r = lambda z: z.reshape(T, k, -1)
        return Dev(r(self.var).sum(1), r(self.mean).sum(1), r(self.big).amax(1), r(self.l1).sum(1))

    def tail(self, t, sigma2, unit=None):
        """P(|G + S| >= t): Bennett's split, or where t passes the terms' summed sizes, the Gaussian part alone
        (`unit` is the Chernoff model's)."""
        t = (t - self.mean).clamp_min(0)
        capped = torch.where(sigma2 > 0, (2 * torch.exp(-((t - self.l1).clamp_min(0)) ** 2
                                                        / (2 * sigma2.clamp_min(1e-300)))).clamp(max=1.0),
                             (t <= self.l1).to(F64))
        bennett = split_tail(t, sigma2, lambda ta: _bennett(ta, self.var, self.big), torch.ones_like(t))
        return torch.minimum(bennett, capped)

    def rounded(self, pt: "Point", sigma2, p, live, wide, shared):
        """The deviation after the point's rounding: a narrow point's own flip (variance p s^2, mean p s, size s); a
        wide one passes its upstream through with one spacing more, a centred term as the present model takes every
        rounding's. (`shared` plays no part here: Bennett's model takes every term as independent.)"""
        q = torch.where(live, p, torch.zeros_like(p))
        narrow = Dev(q * pt.s * pt.s, q * pt.s, pt.s * live, pt.s * live)
        passing = Dev(self.var + sigma2 + pt.s * pt.s, self.mean, torch.maximum(self.big, pt.s), self.l1 + pt.s)
        return fieldwise(lambda a, b: torch.where(wide, a, b), passing, narrow)


MOMENTS = 12                                            # the Chernoff model's series, up to this power
LAMBDAS = torch.exp2(torch.linspace(-4.0, 9.0, 40, dtype=F64))    # its lambdas, in units of 1 / the point's spacing


class Terms:
    """The Chernoff model: a value's deviation as `shift` (flips shared by many values, taken at their worst: a rank
    intermediate reaching every column) plus independent terms, each a flip j of probability p_j and size b_j,
    carried as the moments mom[m] = sum_j p_j b_j^m (m = 0..MOMENTS), their largest size and a Gaussian variance
    (the fp32 errors passed through). log E exp(lambda S) <= sum_j p_j (exp(lambda b_j) - 1), the series of the
    moments, its remainder bounded by the largest size."""

    def __init__(self, shift, mom, big, var):
        self.shift, self.mom, self.big, self.var = shift, mom, big, var

    @staticmethod
    def zero(like):
        z = torch.zeros_like(like)
        return Terms(z, [z] * (MOMENTS + 1), z, z)

    def scaled(self, j):
        a = j.abs()
        return Terms(a * self.shift, [self.mom[0]] + [a ** m * self.mom[m] for m in range(1, MOMENTS + 1)],
                     a * self.big, j * j * self.var)

    def __add__(self, o):
        return Terms(self.shift + o.shift, [x + y for x, y in zip(self.mom, o.mom)], torch.maximum(self.big, o.big),
                     self.var + o.var)

    def through(self, M: torch.Tensor) -> "Terms":
        """Each term reaches out[i] through M[i, j] alone (a diagonal chain before the GEMM): its m-th power
        moment is the GEMM of |M|^m."""
        A = M.abs()
        mom = [_bmv((A > 0).to(F64), self.mom[0])]
        Am = torch.ones_like(A)
        for m in range(1, MOMENTS + 1):
            Am = Am * A
            mom.append(_bmv(Am, self.mom[m]))
        return Terms(_bmv(A, self.shift), mom, _max_bmv(M, self.big), _bmv(M * M, self.var))

    def pooled(self, T, k):
        r = lambda z: z.reshape(T, k, -1)
        return Terms(r(self.shift).sum(1), [r(x).sum(1) for x in self.mom], r(self.big).amax(1), r(self.var).sum(1))

    def tail(self, t, sigma2, unit):
        """P(|dev| >= t): the Gaussian part's own tail beside Chernoff's for the terms (over LAMBDAS / unit, both
        signs), at the best of a few splits of t between them."""
        def chernoff(ta):
            cs = torch.ones_like(ta)
            for g in LAMBDAS.tolist():
                lam = g / unit
                x = lam * self.big
                psi = torch.zeros_like(ta)
                term = torch.ones_like(ta)
                for m in range(1, MOMENTS + 1):
                    term = term * lam / m                         # lambda^m / m!
                    psi = psi + term * self.mom[m]
                psi = psi + self.mom[0] * x ** (MOMENTS + 1) / math.factorial(MOMENTS + 1) * torch.exp(x.clamp(max=700))
                cs = torch.minimum(cs, 2 * torch.exp((psi - lam * ta).clamp(max=0)))
            return torch.where(self.mom[0] > 0, cs, (ta <= 0).to(F64))
        # no share of t for the terms: 1 where there are terms, 0 where none
        return split_tail(t - self.shift, self.var + sigma2, chernoff, (self.mom[0] > 0).to(F64))

    def rounded(self, pt: "Point", sigma2, p, live, wide, shared):
        """After the point's rounding: a narrow point's flip, a term of its own (probability p, size s), or where
        the flip reaches many values at once (`shared`: a rank intermediate), a shift of s taken at its worst; a
        wide point passes its upstream through, and its rounding is one more term of size s."""
        z = torch.zeros_like(p)
        if shared and not os.environ.get("STUDY_OPTIMISTIC"):
            q = _quantile(self, pt, sigma2)
            return Terms(torch.where(wide, q + pt.s, pt.s * live), [z] * (MOMENTS + 1), z, z)
        q = torch.where(live, p, z)
        narrow = Terms(z, [q] + [q * pt.s ** m for m in range(1, MOMENTS + 1)], pt.s * live, z)
        passing = Terms(self.shift, [self.mom[0] + 1] + [self.mom[m] + pt.s ** m for m in range(1, MOMENTS + 1)],
                        torch.maximum(self.big, pt.s), self.var + sigma2)
        return fieldwise(lambda a, b: torch.where(wide, a, b), passing, narrow)


def _quantile(up, pt, sigma2):
    """The smallest multiple of the point's spacing that its deviation passes with probability <= P_MIN."""
    q = torch.full_like(pt.s, math.inf)
    for m in range(0, 200):
        ok = up.tail(m * pt.s, sigma2, pt.s) <= P_MIN
        q = torch.where(ok & torch.isinf(q), m * pt.s, q)
        if not torch.isinf(q).any():
            break
    return q


def fieldwise(fn, first, *rest):
    """A model's deviation (Dev or Terms) with `fn` applied to each field, elementwise across `rest` (a list field:
    each of its tensors)."""
    fields = []
    for vals in zip(*(vars(o).values() for o in (first, *rest))):
        fields.append([fn(*xs) for xs in zip(*vals)] if isinstance(vals[0], list) else fn(*vals))
    return type(first)(*fields)


def _bmv(M, v):
    return torch.bmm(M, v.unsqueeze(-1)).squeeze(-1)


def _max_bmv(M, v, chunk: int = 64):
    """out[p, i] = max_j |M[p, i, j]| v[p, j]."""
    return torch.cat([(M[i:i + chunk].abs() * v[i:i + chunk, None, :]).amax(dim=2) for i in range(0, M.shape[0], chunk)])


LOST = [0.0]


def round_point(pt: "Point", sigma2: torch.Tensor, up, shared: bool = False):
    """(the deviation after the point's rounding, (its flip probability, wide)). Wide: the deviation may pass the
    boundary beyond the nearest with probability over P_MIN, so it is not one spacing at most."""
    p = up.tail(pt.d, sigma2, pt.s)
    wide = up.tail(pt.d + pt.s, sigma2, pt.s) > P_MIN
    live = p > P_MIN
    LOST[0] += float(p[~live & ~wide].sum())
    return up.rounded(pt, sigma2, p, live, wide, shared), (torch.where(wide, torch.ones_like(p), p), wide)


def study(dtype: str = "bfloat16", tokens: int = 256, model: str = "bennett"):
    dt = getattr(torch, dtype)
    case = power.power_cases("cpu", tokens=(tokens,), dtypes=(dtype,))[0]
    spec = [b for b in BUILTINS if b.name == "eager"][0]
    c = power.correct_run(spec, case, "cpu")
    assert c.precision == "one_shot", c.precision
    inp, truth, emu, out = c.inputs, c.truth, c.emulation, c.out.to(F64)
    LOST[0] = 0.0
    Z = Dev if model == "bennett" else Terms

    x = inp.hidden.to(F64)
    T, H = x.shape
    ids = inp.topk_ids.long()
    k = ids.shape[1]
    w = inp.topk_weights.to(torch.float32).to(F64).reshape(-1, 1)          # (P, 1)
    e = ids.reshape(-1)
    tok = torch.arange(T * k) // k
    st = inp.stacked
    slot = inp.token_lora_mapping.long()[tok]
    enabled = st.adapter_enabled.bool()
    has = ((slot >= 0) & enabled[slot.clamp_min(0)]).to(F64)
    W13, W2 = inp.w13.to(F64)[e], inp.w2.to(F64)[e]                         # (P, N1, H), (P, H, I)
    I = W2.shape[2]
    sl = slot.clamp_min(0)
    A13 = [a.to(F64)[sl, e] * has[:, None, None] for a in st.w13_a]         # (P, R, H) per slice
    B13 = [b.to(F64)[sl, e] for b in st.w13_b]                              # (P, I, R)
    A2, B2 = st.w2_a[0].to(F64)[sl, e] * has[:, None, None], st.w2_b[0].to(F64)[sl, e]
    xp = x[tok]                                                              # (P, H)
    acc = lambda n, y, sumsq: U32 * U32 * (n * sumsq + (n + 1) * y * y)    # dot_variance, the reference's bound
    probs = {}

    y1 = _bmv(W13, xp)
    g1 = Point(y1, dt)
    dg1, probs["GEMM1"] = round_point(g1, acc(H, y1, _bmv(W13 * W13, xp * xp)), Z.zero(y1))
    cache = []
    for s_i in range(len(A13)):
        yu = _bmv(A13[s_i], xp)
        u = Point(yu, dt)
        du, probs[f"w13 rank intermediate {s_i}"] = round_point(u, acc(H, yu, _bmv(A13[s_i] ** 2, xp * xp)),
                                                                Z.zero(yu), shared=True)
        yd = _bmv(B13[s_i], u.v)
        dd = Point(yd, dt)
        R = u.v.shape[1]
        ddd, probs[f"w13 delta {s_i}"] = round_point(dd, acc(R, yd, _bmv(B13[s_i] ** 2, u.v * u.v)),
                                                     du.through(B13[s_i]))
        gs = slice(s_i * I, (s_i + 1) * I)
        yc = g1.v[:, gs] + dd.v
        c = Point(yc, dt)
        gpart = fieldwise(lambda f: f[:, gs], dg1)
        dc, probs[f"cache1 {s_i}"] = round_point(c, U32 * U32 * yc * yc, gpart + ddd)
        cache.append((c, dc))
    (cg, dcg), (cu, dcu) = cache
    gate = cg.v.clone().requires_grad_(True)
    sil = torch.nn.functional.silu(gate)
    der = torch.autograd.grad(sil.sum(), gate)[0].detach()
    sil = sil.detach()
    sg = Point(sil, dt)
    dsg, probs["silu"] = round_point(sg, (ACT_ULPS * U32 * sil) ** 2, dcg.scaled(der))
    ya = sg.v * cu.v
    a = Point(ya, dt)
    da, probs["activation"] = round_point(a, U32 * U32 * ya * ya, dsg.scaled(cu.v) + dcu.scaled(sg.v))
    y3 = w * _bmv(W2, a.v)
    c3 = Point(y3, dt)
    WW = w[:, :, None] * W2
    dc3, probs["GEMM2"] = round_point(c3, w * w * acc(I, y3 / w, _bmv(W2 * W2, a.v * a.v)) + U32 * U32 * y3 * y3,
                                      da.through(WW))
    yu2 = _bmv(A2, a.v)
    u2 = Point(yu2, dt)
    du2, probs["w2 rank intermediate"] = round_point(u2, acc(I, yu2, _bmv(A2 ** 2, a.v * a.v)), da.through(A2),
                                                     shared=True)
    WB = w[:, :, None] * B2
    yd2 = _bmv(WB, u2.v)
    d2 = Point(yd2, dt)
    R2 = u2.v.shape[1]
    dd2, probs["w2 delta"] = round_point(d2, w * w * acc(R2, yd2 / w, _bmv(B2 ** 2, u2.v * u2.v))
                                         + U32 * U32 * yd2 * yd2, du2.through(WB))
    y4 = c3.v + d2.v * has[:, None]
    c4 = Point(y4, dt)
    dc4, probs["pair output"] = round_point(c4, U32 * U32 * y4 * y4, dc3 + dd2.scaled(has[:, None].expand_as(y4)))
    Hn = c4.v.shape[1]
    yo = c4.v.reshape(T, k, Hn).sum(1)
    o = Point(yo, dt)
    up = dc4.pooled(T, k)
    sig = acc(k, yo, (c4.v ** 2).reshape(T, k, Hn).sum(1))
    if os.environ.get("STUDY_DEBUG"):
        from moe_lora_harness.harness.build.expert_runner import expert_forward
        from moe_lora_harness.reference.precision import precision as mk
        fwd, args, kw = expert_forward(case, inp)
        ref = fwd(*args, precision=mk("one_shot", dt), magnitudes=False, return_intermediates=True, **kw)
        for name, mine, theirs in (("cache1", torch.cat([cg.v, cu.v], 1), ref.cache1.reshape(T * k, -1)),
                                   ("a", a.v, ref.cache2.reshape(T * k, -1)),
                                   ("cache3", c4.v, ref.cache3.reshape(T * k, -1)), ("out", o.v, ref.value)):
            print(name, "differs at", int((mine != theirs).sum()), "of", mine.numel())
    same = o.v == emu.value      # the study's emulation against the reference's (bit for bit when it is right)
    print(f"the study's emulation differs from the reference's in {int((~same).sum())} of {same.numel()} output "
          f"elements (left out below)")
    n = o.v.numel()
    target = compare.FALSE_VERDICT / n
    steps = torch.full_like(yo, math.inf)
    for m in range(0, 200):      # |out - emu| <= m spacings unless the pre-value moved past d + (m - 1) s
        reach = o.d + max(m - 1, 0) * o.s if m else o.d
        ok = up.tail(reach, sig, o.s) <= target
        steps = torch.where(ok & torch.isinf(steps), torch.full_like(steps, float(m)), steps)
        if not torch.isinf(steps).any():
            break
    if os.environ.get("STUDY_DEBUG"):
        bad = ((out - o.v).abs() / o.s > steps).nonzero()[:8]
        for i, j in bad.tolist():
            f = lambda z: float(z[i, j] / o.s[i, j])
            print(f"  over the bound at ({i}, {j}): dev {f((out - o.v).abs())} bound {float(steps[i, j])} d {f(o.d)} "
                  f"shift {f(up.shift) if hasattr(up, 'shift') else 0} mom0 {float(up.mom[0][i, j]) if hasattr(up, 'mom') else 0} "
                  f"big {f(up.big)} sd {float((up.var[i, j] + sig[i, j]).sqrt() / o.s[i, j])}; the pair outputs: "
                  + ", ".join(f"d {float(c4.d[i * k + r, j] / c4.s[i * k + r, j]):.3g} p {float(probs['pair output'][0][i * k + r, j]):.3g}"
                              f" emu-eager?" for r in range(k)))
    dev = (out - o.v).abs() / o.s
    big_el = (o.v.abs() > 0.5) & same
    eps = torch.finfo(dt).eps
    sd = (truth.round_var.clamp_min(0) * eps ** 2 + truth.acc_var.clamp_min(0)).sqrt() / o.s
    rule2 = compare.sigmas(n) * sd + ((o.v - truth.value).abs() + eps * o.v.abs()) / o.s
    orc = (power.ORACLE_TOL + power.ORACLE_TOL * truth.value.abs()) / o.s
    q = torch.tensor([0.5, 0.99, 1.0], dtype=F64)
    row = lambda name, z: print(f"  {name:<44} " + " / ".join(f"{v:.3g}" for v in z[big_el].quantile(q).tolist()))
    print(f"{dtype} T{tokens} H{H} I{I} E{inp.w13.shape[0]} k{k}, the {model} model: {int(big_el.sum())} elements "
          f"above 0.5 (median / p99 / max, in spacings of the output)")
    row("eager's |out - emu|", dev)
    row("flip-aware bound on |out - emu| (this study)", steps)
    row("  + |emu - truth| (against the truth)", steps + (o.v - truth.value).abs() / o.s)
    row("rule 2's statistical bound on |out - truth|", rule2)
    row("assert_close(2e-2) on |out - truth|", orc)
    row("|emu - truth|", (o.v - truth.value).abs() / o.s)
    print(f"  eager over the study's bound: {int(((dev > steps) & big_el).sum())} elements; flips left out: "
          f"total probability {LOST[0]:.2g}")
    for name, (p, wide) in probs.items():
        print(f"  {name:<24} flip probability: mean {float(p.mean()):.3g}, over 1e-3 at {float((p > 1e-3).to(F64).mean()):.3g} "
              f"of its points, 1 at {float(((p == 1) & ~wide).to(F64).mean()):.3g}; passes its upstream through (wide) at "
              f"{float(wide.to(F64).mean()):.3g}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--model", choices=("bennett", "chernoff"), default="bennett")
    a = ap.parse_args()
    study(a.dtype, a.tokens, a.model)
