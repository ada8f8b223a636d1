"""How alike two summation orders of a short fp32 sum round (forty-eighth session; harness.judge.expectation's
TWIN_MIN_RANK): 200,000 sums of n products of normals, summed in fp32 in two random orders (FMA: each step one
rounding of acc + p; mul-then-add: the product rounded first), against the float64 sum: the correlation of the two
orders' errors, how often they are equal, and their squared difference over one order's square.
`python rank_sum_correlation.py`"""
import torch

torch.manual_seed(0)
M = 200000
for n in [2, 3, 4, 8, 16, 32, 64]:
    v32 = torch.randn(M, n, dtype=torch.float64).float()
    b32 = torch.randn(M, n, dtype=torch.float64).float()
    exact = (v32.double() * b32.double()).sum(1)

    def seq(order, fma):
        acc = torch.zeros(M, dtype=torch.float32)
        for j in order:
            acc = ((acc.double() + v32[:, j].double() * b32[:, j].double()).float() if fma
                   else acc + v32[:, j] * b32[:, j])
        return acc.double()
    for fma in (True, False):
        p1, p2 = torch.randperm(n).tolist(), torch.randperm(n).tolist()
        a, b = seq(p1, fma) - exact, seq(p2, fma) - exact
        rho = float((a * b).mean() / (a * a).mean().sqrt() / (b * b).mean().sqrt())
        print(f"n {n:3d} {'fma' if fma else 'mul+add':8s} rho {rho:.3f} equal {float((a == b).double().mean()):.3f}"
              f"  E(a-b)^2/E a^2 {float(((a - b) ** 2).mean() / (a * a).mean()):.3f}")

# the twin's own pair of orders: the kernel's (0, 1, ..., n-1) against the view's (contraction_order), FMA
from moe_lora_harness.harness.build.properties import contraction_order  # noqa: E402
for n in [8, 16, 32, 64]:
    v32, b32 = torch.randn(M, n).float(), torch.randn(M, n).float()
    exact = (v32.double() * b32.double()).sum(1)

    def fma_seq(order):
        acc = torch.zeros(M, dtype=torch.float32)
        for j in order:
            acc = (acc.double() + v32[:, j].double() * b32[:, j].double()).float()
        return acc.double()
    a, b = fma_seq(range(n)) - exact, fma_seq(contraction_order(n).tolist()) - exact
    print(f"n {n:3d} in order vs contraction_order: rho "
          f"{float((a * b).mean() / (a * a).mean().sqrt() / (b * b).mean().sqrt()):.3f} equal "
          f"{float((a == b).double().mean()):.3f}  E(a-b)^2/E a^2 {float(((a - b) ** 2).mean() / (a * a).mean()):.3f}")
