"""The device a run uses: `--device` parsed (cpu, cuda, cuda:N) and, without CUDA, Triton's interpreter.

One place for the rule, asked by the CLI, the pytest plugin and the supervised worker.
"""
from __future__ import annotations

import contextlib
import os
import re

DEVICE_FORMS = "cpu, cuda or cuda:N"
INTERPRET_ENV = "TRITON_INTERPRET"


def parse_device(text: str, option: str = "--device") -> str:
    """'cpu' | 'cuda' | 'cuda:N' as given; anything else is a ValueError naming the option."""
    if text == "cpu" or re.fullmatch(r"cuda(:\d+)?", text or ""):
        return text
    raise ValueError(f"{option}: expected {DEVICE_FORMS}; got {text!r}")


def interpreting() -> bool:
    """Whether Triton kernels run in its interpreter in this process (TRITON_INTERPRET set and not 0)."""
    return os.environ.get(INTERPRET_ENV, "0") not in ("", "0")


def cuda_present() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no torch, no driver: no CUDA
        return False


def interpret_without_cuda() -> bool:
    """Without CUDA, Triton kernels must run in the interpreter: set TRITON_INTERPRET=1 (unless set) before
    our kernel modules are imported. Returns whether CUDA is present."""
    has_cuda = cuda_present()
    if not has_cuda:
        os.environ.setdefault(INTERPRET_ENV, "1")
    return has_cuda


def prepare_device(text: str | None, option: str = "--device") -> str:
    """The device to run on (default: cuda when present), the interpreter set up where there is no CUDA, and
    for --device cpu on a CUDA host too (compiled Triton kernels cannot read CPU tensors: they run in the
    interpreter, or a correct backend would fail there)."""
    has_cuda = interpret_without_cuda()
    d = parse_device(text, option) if text is not None else ("cuda" if has_cuda else "cpu")
    if d.startswith("cuda") and not has_cuda:
        raise ValueError(f"{option} {d}: no CUDA device is available here")
    if d == "cpu":
        os.environ.setdefault(INTERPRET_ENV, "1")
    return d


@contextlib.contextmanager
def interpreter_switch_kept():
    """TRITON_INTERPRET as it was before the block, whatever the block did: `--device cpu` run in a process on a GPU
    host turns the interpreter on (prepare_device), and a kernel jitted after it in that process is interpreted,
    also on CUDA tensors (our suites wrap each test in it: harness suites run check in-process)."""
    before = os.environ.get(INTERPRET_ENV)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(INTERPRET_ENV, None)
        else:
            os.environ[INTERPRET_ENV] = before
