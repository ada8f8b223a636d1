"""pytest configuration: device choice, Triton interpreter on CPU, backends, hypothesis profile.

Options: --device cpu|cuda (default: cuda when present), --backend module:attr (repeatable, adds a
backend), --only NAME (repeatable, restrict to these backends), --probe-unsupported (also run cases a
backend declines and report those that pass), --cases-per-feature N. Safe under pytest-xdist: every
worker derives the same parametrization from the same options.
"""
from __future__ import annotations

import os

# Must happen before anything imports triton: without a GPU, Triton kernels run in the interpreter.
def _cuda_present() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


if not _cuda_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from harness.strategies import load_profile, register_profiles  # noqa: E402

register_profiles()


def pytest_addoption(parser):
    g = parser.getgroup("moe-lora-harness")
    g.addoption("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.addoption("--backend", action="append", default=[], metavar="MODULE:ATTR",
                help="add a backend: a BackendSpec, a list of them, or a fused_moe_lora-signature function")
    g.addoption("--only", action="append", default=[], metavar="NAME", help="run only these backends")
    g.addoption("--probe-unsupported", action="store_true",
                help="run cases a backend declines too; report the ones that pass")
    g.addoption("--cases-per-feature", type=int, default=None,
                help="cases per feature and backend (default 2 on CPU, 3 on CUDA)")


def pytest_configure(config):
    if not config.getoption("hypothesis_profile", default=None):
        load_profile(None)


def selected_device(config) -> str:
    d = config.getoption("device") or ("cuda" if _cuda_present() else "cpu")
    if d.startswith("cuda") and not _cuda_present():
        raise pytest.UsageError("--device cuda given but no CUDA device is available")
    return d


_BACKENDS = {}


def selected_backends(config):
    """name -> BackendSpec for this session (loaded once per process)."""
    key = (tuple(config.getoption("backend")), tuple(config.getoption("only")))
    if key not in _BACKENDS:
        from harness.registry import available_backends
        specs = available_backends(extra_refs=config.getoption("backend"))
        only = config.getoption("only")
        if only:
            missing = sorted(set(only) - set(specs))
            if missing:
                raise pytest.UsageError(f"--only {missing}: no such backend; known: {sorted(specs)}")
            specs = {n: s for n, s in specs.items() if n in only}
        _BACKENDS[key] = specs
    return _BACKENDS[key]


@pytest.fixture(scope="session")
def device(request) -> str:
    return selected_device(request.config)


@pytest.fixture(scope="session")
def backends(request):
    return selected_backends(request.config)


@pytest.fixture(scope="session")
def probe_unsupported(request) -> bool:
    return request.config.getoption("probe_unsupported")
