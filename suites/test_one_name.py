"""One name per module: the package's modules are importable as `moe_lora_harness.*` only, the repository's
folders are never a second package, and a static tool (jedi, as an editor runs it) resolves every import in
the repository after a plain editable install."""
from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

import moe_lora_harness

PKG = "moe_lora_harness"
PARTS = ("backends", "harness", "kernels", "op_contract", "reference", "suites")
ROOT = pathlib.Path(moe_lora_harness.__file__).resolve().parents[2]     # the checkout (src/moe_lora_harness/..)
IN_SOURCE_TREE = (ROOT / "pyproject.toml").is_file() and (ROOT / "src" / PKG).is_dir()
needs_source = pytest.mark.skipif(not IN_SOURCE_TREE, reason="a checkout only: an installed wheel has no "
                                                             "repository folders to shadow it")


@pytest.mark.parametrize("name", ["moe_lora_harness.moe_lora_harness", "moe_lora_harness.bench",
                                  "moe_lora_harness.examples", "moe_lora_harness.conftest", "moe_lora_harness.src",
                                  "moe_lora_harness.ci", "moe_lora_harness.docs"])
def test_no_second_name_inside_the_package(name):
    assert importlib.util.find_spec(name) is None, f"{name} is importable: a module has two names"


@needs_source
@pytest.mark.parametrize("part", [p for p in PARTS if p != "kernels"])
def test_a_folder_of_the_checkout_is_not_a_package_of_its_own(part):
    """From the repository root (on sys.path as the working directory), `import harness` names the folder
    moe_lora_harness.harness already has: it refuses, naming the one name (no site packages; `kernels`, also a
    package other libraries import, has the next two tests)."""
    r = subprocess.run([sys.executable, "-S", "-c", f"import {part}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and f"is the package moe_lora_harness.{part}" in r.stderr, r.stderr[-2000:]


@needs_source
def test_the_kernels_folder_steps_aside_for_an_installed_kernels(tmp_path):
    """`kernels` is also Hugging Face's package (transformers >= 5 requires and imports it): from the repository
    root, where the checkout's kernels/ shadows it, `import kernels` is the installed one, and nothing of ours is
    loaded under that name. It broke `import peft` there before."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("from kernels.layer import MARK\n")
    (tmp_path / "kernels" / "layer.py").write_text("MARK = 'installed'\n")
    code = ("import kernels, sys\n"
            "print(kernels.MARK, kernels.__file__)\n"
            "print(sorted(n for n, m in sys.modules.items() if n.startswith('kernels')))\n")
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    mark, where = r.stdout.splitlines()[0].split(" ", 1)
    assert mark == "installed" and pathlib.Path(where).resolve().is_relative_to(tmp_path.resolve()), r.stdout
    assert r.stdout.splitlines()[1] == "['kernels', 'kernels.layer']", r.stdout


@needs_source
def test_the_kernels_folder_reads_as_absent_where_none_is_installed():
    """With no `kernels` installed, `import kernels` from the repository root (what transformers' availability
    probe does when no distribution names it) gets a module with no file, no version and no submodules, which such
    a probe takes for "not installed"; any name used on it says which package the folder is. It raised before, and
    `import transformers` with it."""
    code = ("import kernels\n"
            "print(kernels.__file__, getattr(kernels, '__version__', 'N/A'), kernels.__path__)\n"
            "try:\n    import kernels.triton\nexcept ModuleNotFoundError:\n    print('no submodule')\n"
            "kernels.ops\n")
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.stdout.splitlines() == ["None N/A []", "no submodule"], (r.stdout, r.stderr[-2000:])
    assert r.returncode != 0 and "is the package moe_lora_harness.kernels" in r.stderr, r.stderr[-2000:]


def test_every_module_has_one_name():
    """Import every module of the package (tests and helpers included) in a fresh interpreter: no file of ours
    is loaded under two names."""
    code = (
        "import importlib, os, pkgutil, sys\n"
        "import moe_lora_harness as p\n"
        "top = os.path.realpath(p.__path__[0])\n"
        "ours = [top] + [os.path.realpath(os.path.join(top, d)) for d in os.listdir(top)]\n"
        "names = [m.name for m in pkgutil.walk_packages(p.__path__, 'moe_lora_harness.')\n"
        "         if not m.name.endswith('__main__')]\n"
        "for n in names:\n"
        "    importlib.import_module(n)\n"
        "seen = {}\n"
        "for n, m in list(sys.modules.items()):\n"
        "    f = getattr(m, '__file__', None)\n"
        "    if f and any(os.path.realpath(f).startswith(d + os.sep) for d in ours):\n"
        "        seen.setdefault(os.path.realpath(f), set()).add(n)\n"
        "dups = {f: sorted(ns) for f, ns in seen.items() if len(ns) > 1}\n"
        "print(len(names), 'modules,', len(seen), 'files of ours loaded'); print(dups)\n"
        "sys.exit(1 if dups or len(seen) < len(names) else 0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1")))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def _repository_files() -> list[pathlib.Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    if out.returncode:
        return sorted(p for p in ROOT.rglob("*.py") if not any(s.startswith(".") for s in p.relative_to(ROOT).parts))
    return sorted(ROOT / f for f in out.stdout.split() if (ROOT / f).is_file() and not (ROOT / f).is_symlink())


def _imports(path: pathlib.Path):
    """(line, column of the module's last dotted part, module text) of every import statement's module."""
    src = path.read_text()
    lines = src.splitlines()
    for node in ast.walk(ast.parse(src, filename=str(path))):
        if isinstance(node, ast.Import):
            mods = [(a.name, 0) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods = [(node.module or "", node.level)]
        else:
            continue
        line = lines[node.lineno - 1]
        for mod, level in mods:
            text = "." * level + mod
            col = line.find(text, node.col_offset)
            if col < 0 or not mod:
                continue          # `from . import x`: x is checked where it is used
            yield node.lineno, col + len(text) - len(mod.rsplit(".", 1)[-1]), text


def _ours_or_installed(text: str, path: pathlib.Path) -> bool:
    """Checked: relative imports, ours, modules beside a script, and third-party ones this environment has
    (an optional dependency that is not installed cannot be resolved by anyone). Not the standard library: no
    packaging of ours can break it, and its stubs took jedi more than half of this test's time."""
    if text.startswith(".") or text.split(".")[0] == PKG or (path.parent / f"{text.split('.')[0]}.py").exists():
        return True
    if text.split(".")[0] in sys.stdlib_module_names:
        return False
    # installed = found in the environment's site-packages, not on a sys.path another test extended (an example's
    # src/ folder put there made its uninstalled package look installed)
    site = [p for p in sys.path if p and ("site-packages" in p or "dist-packages" in p)]
    try:
        return importlib.machinery.PathFinder.find_spec(text.split(".")[0], site) is not None
    except (ImportError, ValueError):
        return False


def _context_free(text: str, path: pathlib.Path) -> bool:
    """An absolute import that resolves the same from every file (not relative, not a script's sibling)."""
    return not text.startswith(".") and not (path.parent / f"{text.split('.')[0]}.py").exists()


@pytest.mark.starts_first
@needs_source
def test_static_tools_resolve_every_import_of_the_repository(tmp_path, monkeypatch):
    """Each distinct absolute module is resolved once (from one probe file: jedi resolves it the same from every
    file); relative imports and a script's sibling modules from their own file."""
    try:
        import jedi
    except ImportError:
        pytest.fail("this test runs jedi, as an editor does: pip install -e '.[test]'")
    # a cache of its own: jedi's shared one (~/.cache/jedi) was read half-written while another jedi wrote it
    monkeypatch.setattr(jedi.settings, "cache_directory", str(tmp_path / "jedi"))
    project = jedi.Project(str(ROOT), environment_path=sys.prefix)
    files = _repository_files()
    absolute, local = {}, []      # absolute module -> first place it is imported; (path, line, col, text)
    for path in files:
        for line, col, text in _imports(path):
            if not _ours_or_installed(text, path):
                continue
            if _context_free(text, path):
                absolute.setdefault(text, f"{path.relative_to(ROOT)}:{line}")
            else:
                local.append((path, line, col, text))
    probe = jedi.Script("".join(f"import {m}\n" for m in absolute), path=str(ROOT / "_probe.py"), project=project)
    unresolved = [f"{where}: {m}" for i, (m, where) in enumerate(absolute.items(), 1)
                  if not [d for d in probe.goto(i, len(f"import {m}"), follow_imports=True) if d.module_path]]
    scripts = {}
    for path, line, col, text in local:
        script = scripts.setdefault(path, jedi.Script(path=str(path), project=project))
        if not [d for d in script.goto(line, col, follow_imports=True) if d.module_path]:
            unresolved.append(f"{path.relative_to(ROOT)}:{line}: {text}")
    assert len(files) > 100 and len(absolute) > 50 and local
    assert not unresolved, "jedi cannot resolve:\n" + "\n".join(unresolved)
