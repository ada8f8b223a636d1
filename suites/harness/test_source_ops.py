"""Another engine's op module loaded from its unpacked source (harness.source_ops, what examples/vllm_wheel_op and
examples/sglang_wheel_op stand on): the op's own file runs unchanged beside stand-ins for the engine's helpers, its
package's __init__ never runs, and a missing source is an ImportError naming the variable and the file."""
from __future__ import annotations

import sys

import pytest

from moe_lora_harness.harness.source_ops import load_op_module, no_registration, single_rank

OP = '''
from fakeeng import envs
from fakeeng.dist import all_reduce
from fakeeng.utils.common import register

SCALE = 3 if envs.FLAG else 1

def op(x):
    return all_reduce(x) * SCALE

try:
    register("op", op)
    exported = "registered"
except AttributeError:
    exported = "python"
'''


@pytest.fixture
def engine(tmp_path, monkeypatch):
    pkg = tmp_path / "fakeeng" / "ops" / "moe"
    pkg.mkdir(parents=True)
    (tmp_path / "fakeeng" / "__init__.py").write_text("raise RuntimeError('the engine package was imported')\n")
    (pkg / "__init__.py").write_text("raise RuntimeError('the op package was imported')\n")
    (pkg / "kernel.py").write_text(OP)
    monkeypatch.setenv("FAKEENG_SOURCE", str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n == "fakeeng" or n.startswith("fakeeng.")]:
        del sys.modules[name]


def test_the_op_module_runs_unchanged_beside_stand_ins(engine):
    mod = load_op_module("FAKEENG_SOURCE", "fakeeng.ops.moe", "kernel", {
        "fakeeng.envs": {"FLAG": True},
        "fakeeng.dist": {"all_reduce": single_rank},
        "fakeeng.utils.common": {"register": no_registration}})
    assert mod.op(2) == 6 and mod.exported == "registered"
    assert mod.__file__ == str(engine / "fakeeng" / "ops" / "moe" / "kernel.py")
    assert load_op_module("FAKEENG_SOURCE", "fakeeng.ops.moe", "kernel", {}) is mod      # once per process


def test_a_missing_source_names_the_variable_and_the_file(engine, monkeypatch):
    monkeypatch.setenv("FAKEENG_SOURCE", str(engine / "nowhere"))
    with pytest.raises(ImportError, match=r"FAKEENG_SOURCE=.*fakeeng/ops/moe/kernel\.py"):
        load_op_module("FAKEENG_SOURCE", "fakeeng.ops.moe", "kernel", {})
