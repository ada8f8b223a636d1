"""The layout is the architecture: reference/ never imports kernels/ or harness/, kernels/ never imports
the harness (or the reference), and the harness knows backends only through declared contracts."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "reference": {"kernels", "harness", "backends", "triton"},
    "kernels": {"harness", "reference", "backends"},
    "harness": {"kernels", "backends"},
}


def imported_top_levels(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layering(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no modules"
    bad = {str(f.relative_to(ROOT)): sorted(imported_top_levels(f) & FORBIDDEN[package]) for f in files}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"layering violated (module -> forbidden imports): {bad}"


def test_layering_check_detects_a_violation(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import harness.case\nfrom kernels.triton import x\n")
    assert imported_top_levels(p) == {"harness", "kernels"}
