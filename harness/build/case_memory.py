"""What one case needs in memory, and what this machine has free: model mode refuses a case that cannot fit.

An estimate, not a measurement (docs/models.md): the inputs in the case's dtype, held three times (the judge's
copy, the backend's, and the worker's bit-for-bit snapshot of the backend's, which digests a tensor over
SNAPSHOT_MAX_BYTES instead of copying it), a fourth time up to
GUARD_MAX_BYTES (the backend's guarded copies, harness.build.guards), plus the float64 reference's
working set (one expert's weights in float64 at a time and their absolute values for the error magnitudes, the
LoRA factors in float64, and about fifteen float64 arrays per (token, expert) pair at each of the widths N1, I and
H, for a GPU's token chunk at a time; twelve per output column at the op level, eight more where it runs a twin).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.build.expert_runner import token_chunk
from moe_lora_harness.harness.draw.profiles import on_gpu
from moe_lora_harness.harness.build.guards import GUARD_MAX_BYTES, SNAPSHOT_MAX_BYTES
from moe_lora_harness.reference.activations import is_gated
from moe_lora_harness.reference.align import align_sizes

INPUT_COPIES = 3         # the judge's, the backend's, the worker's snapshot (harness.execution.execute.InputWatch),
                         # which holds the tensors of SNAPSHOT_MAX_BYTES or less (MemoryNeed.digested: the others)
# float64 arrays per pair and output column alive at the reference's peak (the truth's value, magnitudes and
# underflow exposure with their temporaries, the emulation's value); measured with suites/harness/test_models.py
OP_PAIR_ARRAYS = 12
# 13 are alive at the peak in a fresh process (10 before the statistical model's acc_var and round_var, issue 30);
# the peak RSS of the same case moves with what the process ran before (0.92-1.02 of the 13-array figure: a CI
# run's test process measured 840 MB against its 827 MB), so two arrays more: the estimate is a bound, not a mean, for
# a fresh process (672-840 MB against 910); a test worker that had run many other tests peaked at 951 MB (its heap's
# history): a long-lived judge process may pass it by a few percent. What is in use (glibc's mmap threshold fixed, so
# that freed large blocks are not reused from a fragmented heap) peaks at 581 MB for that case, steadily: the
# fragmentation moved a fresh process's peak over 670-931 MB (thirty-eighth session)
EXPERT_PAIR_ARRAYS = 15
# an op-level fp32 case, where the judge may run a twin (harness.judge.expectation.twin_applies; counted for every fp32
# op case, since this room does not ask the judge), holds the twin's own truth and emulation
# beside the case's (expectation.twin_own_truth) and computes them at the reference's peak: this many float64 arrays
# per pair and output column more, and the view's inputs (x and every LoRA factor, in the case's dtype). Measured
# (fiftieth session, suites/harness/test_models.py): an fp32 w2 call of 2048 pairs, N 2048, peaked at 886 MB where
# the estimate without them said 667 (6.5 arrays short)
OP_TWIN_ARRAYS = 8
# what the judge allocates whatever the case's size (the reference's chunked weight gathers, its temporaries):
# 60-120 MiB measured at small cases
FIXED = 256 * 2**20
# the worker's digest of its tensors over SNAPSHOT_MAX_BYTES on a GPU (harness.judge.tensor_digest.lane_sums): int64
# temporaries of CHUNK_WORDS words (256 MiB), about five alive at once; six counted (on the CPU, sha1: none)
DIGEST_WORK = 1536 << 20
_ITEM = {"float16": 2, "bfloat16": 2, "float32": 4}
_F64 = 8


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes a case needs: its inputs once (in its dtype) and the float64 reference's working set (beyond FIXED)."""

    inputs: int
    reference: int
    digested: int = 0    # bytes of the inputs in tensors over SNAPSHOT_MAX_BYTES: the worker's snapshot digests them
    # bytes alive only while a process draws the inputs (quantized weights: the drawn weights beside their codes and
    # dequantized values, harness.build.builders), counted once: the worker draws while the judge holds its copy
    building: int = 0

    @property
    def guarded(self) -> int:
        """The backend's guarded copies of the inputs: a call of at most GUARD_MAX_BYTES has them."""
        return self.inputs if self.inputs <= GUARD_MAX_BYTES else 0

    @property
    def work(self) -> int:
        """Beyond the inputs' copies: the float64 reference, FIXED, and the digest's temporaries where it runs."""
        return self.reference + FIXED + (DIGEST_WORK if self.digested else 0)

    @property
    def total(self) -> int:
        return INPUT_COPIES * self.inputs - self.digested + self.guarded + self.work + self.building

    def describe(self) -> str:
        copies = INPUT_COPIES - (1 if self.digested else 0) + (1 if self.guarded else 0)
        snapshot = (f" + {gib(self.inputs - self.digested)} of them snapshotted (the {gib(self.digested)} in tensors "
                    f"over {SNAPSHOT_MAX_BYTES >> 20} MiB digested)") if self.digested else ""
        building = f" + {gib(self.building)} while the inputs are drawn" if self.building else ""
        return (f"needs {gib(self.total)} ({copies} x {gib(self.inputs)} of inputs in the case's dtype{snapshot} + "
                f"{gib(self.work)} for the float64 reference{' and the digest' if self.digested else ''}{building})")


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def memory_need(case: Case, device: str = "cpu") -> MemoryNeed:
    """The estimate for an op- or expert-level case run on `device` (harness.build.builders allocates these tensors)."""
    item = _ITEM[case.dtype]
    T, H, I, k, L, R = case.T, case.H, case.I, case.top_k, case.max_loras, case.max_rank
    P = T * k
    if case.level == "op":
        E = case.local_experts
        S = case.num_slices
        lora = S * L * E * R * (case.K + case.N)
        rows = P if case.mul_routed_weight else T
        elems = rows * case.K + P * case.width + lora
        ref = _F64 * (lora + OP_PAIR_ARRAYS * P * case.width + rows * case.K)
        if case.dtype == "float32":      # where the judge may run a twin (it runs one on fp32 op calls alone)
            ref += _F64 * OP_TWIN_ARRAYS * P * case.width + item * (lora + rows * case.K)
        index = 16 * P + 4 * (case.E + T + 2 * L + 2)             # routing, mapping, expert_map, slot ids
        if case.layout == "sorted":                               # the align's int32 buffers (L, M) and (L, MB)
            M, MB = align_sizes(P, case.block_size_m, case.E)
            index += 4 * L * (M + MB + 1)
        return MemoryNeed(item * elems + index, ref)        # its snapshot counted whole: a bound
    gated = is_gated(case.activation)
    E = case.E if case.dispatched else case.local_experts
    N1 = 2 * I if gated else I
    weights = E * (N1 * H + H * I)
    lora = ((2 if gated else 1) + 1) * L * E * R * (H + I) if case.lora else 0
    bias = E * (N1 + H) if case.bias else 0
    elems = 2 * T * H + weights + lora + bias          # hidden states and the output, weights, adapters, biases
    quant = weights if case.quant != "none" else 0      # int8 codes beside the dequantized weights
    # the reference holds one expert's weights in float64 at a time (value and magnitude), and on a GPU computes
    # the pairs of `token_chunk` tokens at a time (harness.build.expert_runner); the (T, H) results are whole
    one_expert = N1 * H + H * I
    chunk_pairs = min(T, token_chunk(case)) * k if on_gpu(device) and not case.dispatched else P
    ref = _F64 * (2 * one_expert + lora + bias + EXPERT_PAIR_ARRAYS * chunk_pairs * (N1 + I + H) + 3 * T * H)
    return MemoryNeed(item * elems + quant + 16 * P, ref, _digested(case, item, E, N1), item * quant)


def _digested(case: Case, item: int, E: int, N1: int) -> int:
    """The bytes of an expert-level case's inputs that the worker's snapshot digests: the hidden states and each
    weight tensor (w13, w2 in the case's dtype; quantized, their one-byte codes too) over SNAPSHOT_MAX_BYTES, where
    one rank holds them whole (TP and EP ranks hold shards: counted as copied, a bound); the rest counted copied."""
    if case.tp_size > 1 or case.ep_size > 1:
        return 0
    H, I = case.H, case.I
    tensors = [item * case.T * H, item * E * N1 * H, item * E * H * I]
    if case.quant != "none":
        tensors += [E * N1 * H, E * H * I]
    return sum(b for b in tensors if b > SNAPSHOT_MAX_BYTES)


def reference_work(case: Case) -> int:
    """The float64 reference's multiply-adds for a case (the routed pairs' GEMMs and LoRA products, or the op's
    shrink and expand): what the judge computes, to tell a case a CPU judges quickly."""
    P, R = case.T * case.top_k, case.max_rank
    if case.level == "op":
        return P * case.num_slices * R * (case.K + case.N)
    lora = 2 * R * (case.N1 + case.H + 2 * case.I) if case.lora else 0
    return P * (case.N1 * case.H + case.H * case.I + lora)


def _host_free() -> int:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping), else free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_bytes(device: str) -> tuple[int, str]:
    """(bytes free, what they are) where the case would live: host RAM on the CPU, GPU memory on CUDA."""
    if str(device).startswith("cuda"):
        import torch
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free), f"free GPU memory on {device}"
    return _host_free(), "available host RAM"
