"""Device queries the launch heuristics need (SM count, shared memory, compute capability).

Cached per device. Under TRITON_INTERPRET=1 or on a CPU device there is no answer to ask for, so a
small fixed CPU default is returned (small, so interpreted grids stay cheap).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceInfo:
    """What the heuristics read: multiprocessor count, opt-in shared memory per block, capability."""

    sm_count: int
    max_shared_mem: int
    capability: tuple[int, int]
    interpreted: bool


# The interpreter runs programs one by one: a small "SM count" keeps heuristic grids small there.
CPU_DEFAULT = DeviceInfo(sm_count=4, max_shared_mem=232448, capability=(9, 0), interpreted=True)


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _cuda_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 49152)
    return DeviceInfo(
        sm_count=int(props.multi_processor_count),
        max_shared_mem=int(smem),
        capability=(int(props.major), int(props.minor)),
        interpreted=False,
    )


def device_info(device: torch.device | str | None) -> DeviceInfo:
    """DeviceInfo for `device` (a CUDA device's properties, else the CPU default), cached per device."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda" or interpreting():
        return CPU_DEFAULT
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return _cuda_info(index)
