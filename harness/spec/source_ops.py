"""Loading another engine's op module from its unpacked source (a wheel's files), without installing the engine:
its package folder is mounted as it is (its `__init__` not run) and the engine's helper modules the op imports are
replaced by stand-ins the wrapper names, the common ones here (collectives, the custom-op registrar, the logger, the
device queries). What examples/vllm_wheel_op, examples/vllm_wheel_experts and examples/sglang_wheel_op are built on.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
import types


def source_package(env_var: str, package: str, module: str) -> str:
    """The folder of `package` under the root `env_var` names, holding `module`.py; ImportError naming the variable
    and the file expected where it does not."""
    root = os.environ.get(env_var, "")
    folder = os.path.join(root, *package.split("."))
    if not root or not os.path.isfile(os.path.join(folder, f"{module}.py")):
        raise ImportError(f"{env_var}={root!r}: expected the folder holding the unpacked source of "
                          f"{package.split('.')[0]}/ (with {package.replace('.', '/')}/{module}.py)")
    return folder


def single_rank(x, *args, **kwargs):
    """A tensor-parallel collective on one rank (all-gather and all-reduce alike): the tensor itself."""
    return x


def no_registration(*args, **kwargs):
    """A custom-op registrar that registers nothing: an op module then exports its Python functions."""


def load_op_module(env_var: str, package: str, module: str, stand_ins: dict) -> types.ModuleType:
    """Import `package.module` from the source under `env_var`, after installing `stand_ins` (module name ->
    attributes) and an empty package for every parent of `package` not among them. Installed once per process."""
    name = f"{package}.{module}"
    if name in sys.modules:
        return sys.modules[name]
    folder = source_package(env_var, package, module)
    for full in (*stand_ins, package):         # every parent first, as an empty package unless a stand-in
        parts = full.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent not in sys.modules:
                _module(parent, path=[], **stand_ins.get(parent, {}))
    for mod_name, attrs in stand_ins.items():
        if mod_name not in sys.modules:
            _module(mod_name, path=[], **attrs)
    _module(package, path=[folder])
    return importlib.import_module(name)


class _OnceLogger(logging.LoggerAdapter):
    """The standard logger with the `*_once` methods engines add (each logs like the plain call)."""

    def warning_once(self, msg, *a, **k):
        self.log(logging.WARNING, msg, *a)

    def info_once(self, msg, *a, **k):
        self.log(logging.INFO, msg, *a)

    def debug_once(self, msg, *a, **k):
        self.log(logging.DEBUG, msg, *a)


def init_logger(name: str) -> logging.LoggerAdapter:
    """An engine's `init_logger`: the standard logger `name`, with its `*_once` methods."""
    return _OnceLogger(logging.getLogger(name), {})


def max_shared_memory_bytes(device_id: int | None = 0) -> int:
    """A device's shared memory per block (the opt-in maximum), an engine's launch heuristics' query; an H100/H200's
    228 KiB where no GPU is (the CPU interpreter runs the GPU path's heuristics)."""
    import torch
    if not torch.cuda.is_available():
        return 228 * 1024
    props = torch.cuda.get_device_properties(device_id or 0)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block)


def tensor_h2d(data, dtype, target_device=None, pin_memory=False, *, device=None):
    """An engine's asynchronous host-to-device tensor helper, synchronously: the same tensor."""
    import torch
    return torch.tensor(data, dtype=dtype, device=device if device is not None else target_device)


def set_triton_allocator(device):
    """Triton's scratch allocator (TMA descriptors) on `device`, as an engine sets it."""
    import torch
    import triton
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device=device, dtype=torch.int8))


def stand_in_module(name: str, cls=types.ModuleType, path: list | None = None, **attrs) -> types.ModuleType:
    """Install module `name` (of class `cls`; a package where `path` is given) holding `attrs`, bound on its parent."""
    return _module(name, path, cls=cls, **attrs)


def _module(name: str, path: list | None = None, cls=types.ModuleType, **attrs) -> types.ModuleType:
    mod = cls(name)
    if path is not None:
        mod.__path__ = path
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, mod)
    return mod
