"""Planted kernel defects made from our kernels' own source: one function recompiled with textual edits, and
bound in place of the original only while a mutant backend runs.

`mutated(fn, edits)` recompiles `fn` (a @triton.jit function or a plain one) from `inspect.getsource`, each
`Edit` applied once, in a copy of its module's globals (`uses` replaces names there, e.g. a mutated callee), so
the kernels' modules are never edited. An edit whose text is missing, or present more than once, raises
`SourceEditError`: a kernel change breaks the mutant loudly instead of leaving it silently correct.
`installed(...)` binds replacements wherever a loaded module of the package binds the originals, and puts the
originals back when the block ends, whatever happens in it. How the production mutants use it:
docs/production-mutants.md.
"""
from __future__ import annotations
import __future__

import inspect
import itertools
import linecache
import sys
import textwrap
import threading
from contextlib import contextmanager
from dataclasses import dataclass

_PACKAGE = "moe_lora_harness"
# every flag a `from __future__ import` sets on code: a recompiled function keeps its module's
_FUTURE_FLAGS = 0
for _name in __future__.all_feature_names:
    _FUTURE_FLAGS |= getattr(__future__, _name).compiler_flag


class SourceEditError(ValueError):
    """An edit that does not apply exactly once to the source it targets."""


@dataclass(frozen=True)
class Edit:
    """Replace `old` (which must occur exactly once in the function's source) with `new`."""

    old: str
    new: str


def _python_function(fn):
    """The Python function behind `fn` (a Triton JIT or interpreted function keeps it as `.fn`)."""
    inner = getattr(fn, "fn", None)
    return inner if inspect.isfunction(inner) else fn


def _is_triton(fn) -> bool:
    return _python_function(fn) is not fn


def apply_edits(source: str, edits, where: str) -> str:
    """`source` with every edit applied; each edit's text must occur in `source` exactly once."""
    for e in edits:
        if not isinstance(e, Edit):
            raise TypeError(f"edits must be Edit records; got {type(e).__name__}")
        n = source.count(e.old)
        if n != 1:
            raise SourceEditError(f"edit target {e.old!r} occurs {n} times in {where}, not exactly once: the "
                                  "kernel changed; update the mutant to the new source")
        source = source.replace(e.old, e.new)
    return source


_serial = itertools.count()
_FILE = "<source-mutant "       # how the (linecache) file name of every recompiled function begins


def is_mutated(fn) -> bool:
    """Whether `fn` (a Python or Triton function) was made by `mutated`."""
    code = getattr(_python_function(fn), "__code__", None)
    return code is not None and code.co_filename.startswith(_FILE)


def mutated(fn, edits=(), *, uses=None, tag: str = "mutant"):
    """`fn` recompiled from its source with `edits`, in a copy of its module's globals updated with `uses`
    ({name: object}); a Triton function stays one (its decorator is part of the source). The new source is
    registered with linecache under a name of its own, so Triton (compiler and interpreter) can read it."""
    py = _python_function(fn)
    if not inspect.isfunction(py):
        raise TypeError(f"fn must be a Python or @triton.jit function; got {type(fn).__name__}")
    edits = tuple(edits)
    if not edits and not uses:
        raise ValueError("a mutation needs at least one edit, or `uses` (a callee to recompile against)")
    where = f"{py.__module__}.{py.__qualname__}"
    source = apply_edits(textwrap.dedent(inspect.getsource(py)), edits, where)
    filename = f"{_FILE}{tag} #{next(_serial)}: {where}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    scope = dict(py.__globals__)
    unknown = sorted(set(uses or {}) - set(scope))
    if unknown:
        raise ValueError(f"uses names {unknown}, which {py.__module__} does not define")
    scope.update(uses or {})
    exec(compile(source, filename, "exec", flags=py.__code__.co_flags & _FUTURE_FLAGS, dont_inherit=True), scope)
    made = scope[py.__name__]
    if _is_triton(made) != _is_triton(fn):
        raise TypeError(f"the recompiled {where} is {type(made).__name__}, the original {type(fn).__name__}: an "
                        "edit touched the decorator")
    return made


def bindings(obj) -> list:
    """(module, attribute) of every loaded module of the package whose attribute is `obj` itself."""
    out = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == _PACKAGE or name.startswith(_PACKAGE + ".")):
            continue
        out += [(mod, attr) for attr, value in list(vars(mod).items()) if value is obj]
    return out


_lock = threading.Lock()
_active: dict = {}       # (module name, attribute) -> [original, replacement, holders]


@contextmanager
def installed(*swaps):
    """Within the block, each `(original, replacement)` is bound wherever a loaded module of the package binds
    `original`; the originals are back when it ends (an error included). Threads of one mutant (simulated ranks)
    may hold the same swap at once; a different replacement for a binding already swapped is refused."""
    held = []
    try:
        with _lock:
            for original, replacement in swaps:
                sites = bindings(original)
                for mod, attr in _swapped_sites(original):
                    if (mod, attr) not in sites:
                        sites.append((mod, attr))
                if not sites:
                    raise LookupError(f"no loaded module of {_PACKAGE} binds {original!r}: nothing to replace")
                for mod, attr in sites:
                    key = (mod.__name__, attr)
                    entry = _active.get(key)
                    if entry is None:
                        _active[key] = entry = [original, replacement, 0]
                        setattr(mod, attr, replacement)
                    elif entry[1] is not replacement:
                        raise RuntimeError(f"{mod.__name__}.{attr} is already replaced by another mutant: mutants "
                                           "do not nest")
                    entry[2] += 1
                    held.append((mod, attr, key))
        yield
    finally:
        with _lock:
            for mod, attr, key in reversed(held):
                entry = _active[key]
                entry[2] -= 1
                if entry[2] == 0:
                    setattr(mod, attr, entry[0])
                    del _active[key]


def _swapped_sites(original) -> list:
    """Bindings of `original` that another thread of the same mutant has swapped out already."""
    return [(sys.modules[name], attr) for (name, attr), (orig, _, _) in _active.items() if orig is original]
