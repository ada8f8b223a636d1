"""A digest of tensors computed where they lie: each tensor's bytes, read as 64-bit words, hashed by integer ops on
its own device, so digesting gigabytes on a GPU moves 16 bytes per tensor to the host, not the tensor.

Two 64-bit sums per tensor (wrapping): of mix(word + position * GOLDEN) and of mix(word ^ SALT) * (2 position + 1),
where mix is splitmix64's finalizer, a bijection of 64-bit words. So any one changed word changes both sums, a
moved word changes them too, and the values are the same on every device (integer arithmetic is exact): the judge
and the worker agree whatever device each digests on. It guards against accidents (a backend that changed the
worker's state), not an adversary; the CPU keeps its sha1 of the bytes (harness.execution.execute.inputs_digest).
"""
from __future__ import annotations

import hashlib

import torch


def _i64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with its bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


GOLDEN = _i64(0x9E3779B97F4A7C15)
SALT = _i64(0xD1B54A32D192ED03)
_M1 = _i64(0xBF58476D1CE4E5B9)
_M2 = _i64(0x94D049BB133111EB)
CHUNK_WORDS = 1 << 25           # words hashed per pass: int64 temporaries of 256 MiB each


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 words (wrapping multiplies): a bijection."""
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def words(t: torch.Tensor) -> torch.Tensor:
    """t's bytes in memory order (row-major, whatever its strides) as int64 words; the last word zero-padded."""
    b = t.detach().reshape(-1)
    if not b.is_contiguous() or b.storage_offset() * b.element_size() % 8:
        b = b.clone()
    b = b.view(torch.uint8)
    whole = b.numel() // 8 * 8
    head = b[:whole].view(torch.int64)
    if whole == b.numel():
        return head
    tail = torch.zeros(8, dtype=torch.uint8, device=b.device)
    tail[:b.numel() - whole] = b[whole:]
    return torch.cat([head, tail.view(torch.int64)])


def lane_sums(t: torch.Tensor) -> torch.Tensor:
    """(2,) int64 on t's device: the two wrapping sums of t's words (module docstring)."""
    w = words(t)
    acc = torch.zeros(2, dtype=torch.int64, device=w.device)
    for start in range(0, w.numel(), CHUNK_WORDS):
        part = w[start:start + CHUNK_WORDS]
        pos = torch.arange(start, start + part.numel(), dtype=torch.int64, device=w.device)
        acc[0] += mix(part + pos * GOLDEN).sum()
        acc[1] += (mix(part ^ SALT) * (2 * pos + 1)).sum()
    return acc


def digest(named) -> str:
    """sha1 over every (name, tensor)'s name, shape, dtype and lane sums: one transfer of 16 bytes per tensor."""
    named = list(named)
    sums = [lane_sums(t) for _, t in named]
    host = [s.cpu() for s in sums]       # the only copies to the host (each waits for its device)
    h = hashlib.sha1()
    for (name, t), s in zip(named, host):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(s.numpy().tobytes())
    return h.hexdigest()
