"""Backend registry: every backend is loaded from a "module:attr" (or "path/to/file.py:attr") reference.

Sources, in order: the entry-point group `moe_lora_harness.backends` (our built-ins register there too,
as `BUILTIN_REF`; from a source tree that is not installed that one reference is used directly), then any
`--backend REF`. A reference may name a BackendSpec, a list of them, or a function with vLLM 0.33.0's
`fused_moe_lora` positional parameters (wrapped as an op-level backend). Nothing is ever called to find
out what it is. A backend's name is short (the spec's name, or a function's attribute name); the
reference it came from is kept as `spec.origin`, and `replay_prefix` turns it into what a REPRO needs.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
from importlib import metadata

from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.contract import BackendSpec, Capabilities
from moe_lora_harness.op_contract.validate import ARGS, SIGNATURE

ENTRY_POINT_GROUP = "moe_lora_harness.backends"
BUILTIN_REF = "moe_lora_harness.backends:BUILTINS"



class BackendLoadError(ValueError):
    """A backend reference could not be loaded; the message says which and why."""


def vllm_dispatch_precision(case: Case) -> str:
    """Rounding model of the path vLLM 0.33.0's dispatch takes for this case (the reference's rule)."""
    from moe_lora_harness.reference.precision import vllm_dispatch_path
    return vllm_dispatch_path(naive=case.layout == "naive", max_rank=case.max_rank,
                              num_pairs=case.T * case.top_k, fully_sharded=case.fully_sharded)


def takes_fused_moe_lora_args(fn) -> bool:
    """True if `fn` accepts the keyword arguments the harness passes an op (vLLM's fused_moe_lora
    signature); inspected, never called."""
    if inspect.isclass(fn):
        return False
    try:
        inspect.signature(fn).bind(**dict.fromkeys(SIGNATURE.parameters))
    except (TypeError, ValueError):
        return False
    return True


def wrap_op_function(fn, name: str, ref: str) -> BackendSpec:
    """An op-level backend around a plain fused_moe_lora-signature function; it claims every op case."""
    return BackendSpec(
        name=name,
        description=f"plain fused_moe_lora function {ref} (claims every op-level case; rounding model "
                    f"follows vLLM 0.33.0's dispatch)",
        capabilities=Capabilities(levels=frozenset({"op"})),
        op=fn, precision=vllm_dispatch_precision, origin=ref)


def is_wrapped_function(spec: BackendSpec) -> bool:
    """Whether `spec` is a plain function wrapped by `wrap_op_function` (it claims everything: it cannot declare
    a limit)."""
    return spec.description.startswith("plain fused_moe_lora function ")


def _import(mod_name: str, ref: str):
    if mod_name.endswith(".py"):
        path = os.path.abspath(mod_name)
        if not os.path.isfile(path):
            raise BackendLoadError(f"--backend {ref!r}: no such file {path}")
        spec = importlib.util.spec_from_file_location(f"_mlh_user_{abs(hash(path))}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod   # so its functions pickle and its dataclasses resolve
        spec.loader.exec_module(mod)
        return mod
    try:
        return importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        # as `python -m` would: a module in the working directory
        if e.name != mod_name.split(".")[0] or os.getcwd() in sys.path:
            raise
        sys.path.append(os.getcwd())
        return importlib.import_module(mod_name)


def load_attr(ref: str):
    """The object "module:attr" (or "path/to/file.py:attr") names, e.g. a backend's setup callable."""
    if ":" not in ref:
        raise BackendLoadError(f"{ref!r}: expected 'module:attr' or 'path/to/file.py:attr'")
    mod_name, attr = ref.rsplit(":", 1)
    try:
        mod = _import(mod_name, ref)
    except BackendLoadError:
        raise
    except BaseException as e:  # noqa: BLE001 - reported with its cause
        raise BackendLoadError(f"{ref!r}: cannot import {mod_name!r}: {type(e).__name__}: {e}") from e
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise BackendLoadError(f"{ref!r}: module {mod_name!r} has no attribute {attr!r}") from None


def load_ref(ref: str) -> list[BackendSpec]:
    """Load "module:attr" (or "path/to/file.py:attr") into one or more BackendSpecs, origin = `ref`."""
    if ":" not in ref:
        raise BackendLoadError(f"--backend {ref!r}: expected 'module:attr' (e.g. mypkg.moe:fused_moe_lora) "
                               f"or 'path/to/file.py:attr'")
    mod_name, attr = ref.rsplit(":", 1)
    if mod_name.endswith(".py"):
        ref = f"{os.path.abspath(mod_name)}:{attr}"   # a REPRO must load it from any directory
    try:
        mod = _import(mod_name, ref)
    except BackendLoadError:
        raise
    except BaseException as e:  # noqa: BLE001 - an import that raises (or exits) is reported with its cause
        raise BackendLoadError(f"--backend {ref!r}: cannot import {mod_name!r}: {type(e).__name__}: {e}") from e
    try:
        obj = getattr(mod, attr)
    except AttributeError:
        raise BackendLoadError(f"--backend {ref!r}: module {mod_name!r} has no attribute {attr!r}") from None
    return _as_specs(obj, attr, ref)


def _as_specs(obj, attr: str, ref: str) -> list[BackendSpec]:
    if isinstance(obj, BackendSpec):
        return [dataclasses.replace(obj, origin=ref)]
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(o, BackendSpec) for o in obj):
        return [dataclasses.replace(o, origin=ref) for o in obj]
    if callable(obj) and takes_fused_moe_lora_args(obj):
        return [wrap_op_function(obj, attr, ref)]
    what = "a class" if inspect.isclass(obj) else type(obj).__name__
    raise BackendLoadError(
        f"--backend {ref!r}: expected a BackendSpec, a non-empty list of them, or a function taking "
        f"fused_moe_lora's arguments ({', '.join(ARGS[:3])}, ...); got {what}"
        + (" (an experts class needs a BackendSpec: see moe_lora_harness.backends.experts.spec_for)"
           if inspect.isclass(obj) else ""))


def entry_point_refs() -> list[str]:
    """'module:attr' strings registered under the entry-point group by installed distributions."""
    return [ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)]


def available_backends(extra_refs=(), include_builtin=True) -> dict[str, BackendSpec]:
    """Every backend by name: entry points (or BUILTIN_REF when not installed), then `extra_refs`.

    A reference that fails to load is an error, not a silent omission; two backends with one name too.
    """
    refs = []
    if include_builtin:
        refs += entry_point_refs()
        if BUILTIN_REF not in refs:
            refs.insert(0, BUILTIN_REF)
    for r in extra_refs:
        if r not in refs:
            refs.append(r)
    out: dict[str, BackendSpec] = {}
    for ref in refs:
        for spec in load_ref(ref):
            old = out.get(spec.name)
            if old is not None and old.origin != spec.origin:
                raise BackendLoadError(f"two backends are named {spec.name!r} ({old.origin} and {spec.origin}); "
                                       f"rename one (a BackendSpec's name, or the function's attribute)")
            out[spec.name] = spec
    return out


def select(specs: dict[str, BackendSpec], only) -> dict[str, BackendSpec]:
    """The backends `--only` names (by short name or by the reference they came from)."""
    if not only:
        return specs
    picked, missing = {}, []
    for want in only:
        hits = {n: s for n, s in specs.items() if want in (n, s.origin)}
        if not hits and want.rsplit(":", 1)[0].endswith(".py"):
            path, _, attr = want.rpartition(":")
            hits = {n: s for n, s in specs.items() if s.origin == f"{os.path.abspath(path)}:{attr}"}
        if not hits:
            missing.append(want)
        picked.update(hits)
    if missing:
        raise BackendLoadError(f"--only {missing}: no such backend; known: {sorted(specs)}")
    return {n: s for n, s in specs.items() if n in picked}


# -- replaying in a fresh shell ---------------------------------------------------------------------------

def is_registered(spec: BackendSpec) -> bool:
    """True if a fresh `moe-lora-harness` finds this backend without --backend (an entry point names it)."""
    return spec.origin in entry_point_refs() or spec.origin == BUILTIN_REF


def import_root(ref: str) -> str | None:
    """The directory a fresh shell must put on PYTHONPATH to import `ref`'s module (None: it needs none)."""
    mod_name = ref.rsplit(":", 1)[0]
    if mod_name.endswith(".py"):
        return None   # loaded by path
    top = mod_name.split(".")[0]
    file = getattr(sys.modules.get(top), "__file__", None)
    if not file:
        return None
    path = os.path.dirname(os.path.realpath(file))   # the package's folder, or the module's own
    root = os.path.dirname(path) if os.path.basename(file) == "__init__.py" else path
    return None if root in fresh_shell_path() else root


@functools.lru_cache(maxsize=None)
def fresh_shell_path() -> frozenset:
    """The sys.path entries (resolved) of a fresh interpreter of this environment: no PYTHONPATH, another
    directory."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import json, sys; print(json.dumps(sys.path))"
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd="/", capture_output=True, text=True,
                             timeout=60)
        return frozenset(os.path.realpath(p) for p in json.loads(out.stdout) if p)
    except (OSError, subprocess.SubprocessError, ValueError):
        return frozenset()


def replay_path(spec: BackendSpec) -> list[str]:
    """The folders a fresh shell must put on PYTHONPATH to load `spec`: the one its module came from, then every
    entry of this process's PYTHONPATH (the backend's module may import from any of them), less those a fresh
    interpreter of this environment has anyway."""
    entries = [import_root(spec.origin)] if spec.origin else []
    entries += [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    fresh, out = fresh_shell_path(), []
    for e in entries:
        if e and os.path.isdir(e) and os.path.realpath(e) not in fresh and e not in out:
            out.append(e)
    return out


def replay_prefix(spec: BackendSpec) -> tuple[str, str]:
    """(environment prefix, --backend arguments) a REPRO needs to load `spec` in a fresh shell: the folders a
    fresh shell lacks (for our own backends too, where the package itself is on PYTHONPATH, not installed), and
    the reference of a backend no entry point registers."""
    import shlex
    path = replay_path(spec) if spec.origin else []
    env = f"PYTHONPATH={shlex.quote(os.pathsep.join(path))} " if path else ""
    backend = "" if not spec.origin or is_registered(spec) else f" --backend {shlex.quote(spec.origin)}"
    return env, backend


def harness_command() -> str:
    """How a fresh shell runs the harness: its console script where it is on PATH, else this Python with -m (a
    source tree run with PYTHONPATH, not installed)."""
    import shlex
    import shutil
    if shutil.which("moe-lora-harness"):
        return "moe-lora-harness"
    return f"{shlex.quote(sys.executable)} -m moe_lora_harness"
