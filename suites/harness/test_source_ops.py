"""Another engine's op module loaded from its unpacked source (harness.spec.source_ops, what examples/vllm_wheel_op and
examples/sglang_wheel_op stand on): the op's own file runs unchanged beside stand-ins for the engine's helpers, its
package's __init__ never runs, and a missing source is an ImportError naming the variable and the file."""
from __future__ import annotations

import pathlib
import sys

import pytest

from moe_lora_harness.harness.spec.source_ops import load_op_module, no_registration, single_rank

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


_EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
WRAPPERS = {"vllm_op": ("vllm_wheel_op/vllm_wheel_op.py:VLLM_OP", "VLLM_SOURCE"),
            "sglang_op": ("sglang_wheel_op/sglang_wheel_op.py:SGLANG_OP", "SGLANG_SOURCE")}


@pytest.mark.skipif(not _EXAMPLES.is_dir(), reason="the examples/ folder is not beside an installed package")
@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_the_example_wrappers_load_and_name_their_missing_source(name, monkeypatch):
    """The vLLM and SGLang wrappers load through the registry without their engine (the op module is read at the
    first call), declare their precision per device, and a call without the source names the variable to set."""
    from moe_lora_harness.harness.spec.case import Case
    from moe_lora_harness.harness.spec.registry import load_ref
    ref, var = WRAPPERS[name]
    monkeypatch.delenv(var, raising=False)
    engine = name.split("_")[0]
    for mod in [m for m in sys.modules if m == engine or m.startswith(engine + ".")]:
        monkeypatch.delitem(sys.modules, mod)           # as in a fresh process, whatever ran before
    spec, = load_ref(str(_EXAMPLES / ref))
    assert spec.name == name and spec.known_bugs
    case = Case.from_json('{"T":5,"dtype":"float32"}')
    assert "tf32" in spec.precision_for(case, "cuda") and "tf32" not in spec.precision_for(case, "cpu")
    with pytest.raises(ImportError, match=var):
        spec.op()


EXPERT_WRAPPERS = {"vllm_experts": ("vllm_wheel_experts/vllm_wheel_experts.py:VLLM_EXPERTS", "VLLM_SOURCE")}


@pytest.mark.skipif(not _EXAMPLES.is_dir(), reason="the examples/ folder is not beside an installed package")
@pytest.mark.parametrize("name", sorted(EXPERT_WRAPPERS))
def test_the_expert_wrappers_load_and_name_their_missing_source(name, monkeypatch):
    """vLLM's TritonExperts wrapper loads through the registry without vLLM (its files are read at the first call),
    declares an expert-level backend with its precision per device, and a call without the source names the
    variable to set."""
    import torch

    from moe_lora_harness.harness.spec.case import Case
    from moe_lora_harness.harness.spec.contract import ExpertCall
    from moe_lora_harness.harness.spec.registry import load_ref
    ref, var = EXPERT_WRAPPERS[name]
    monkeypatch.delenv(var, raising=False)
    engine = name.split("_")[0]
    for mod in [m for m in sys.modules if m == engine or m.startswith(engine + ".")]:
        monkeypatch.delitem(sys.modules, mod)
    spec, = load_ref(str(_EXAMPLES / ref))
    assert spec.name == name and spec.experts is not None and spec.capabilities.levels == frozenset({"expert"})
    case = Case.from_json('{"T":5,"dtype":"float32","level":"expert"}')
    assert "tf32" in spec.precision_for(case, "cuda") and "tf32" not in spec.precision_for(case, "cpu")
    x = torch.zeros(2, 8)
    call = ExpertCall(output=torch.empty(2, 8), hidden_states=x, w13=torch.zeros(2, 16, 8), w2=torch.zeros(2, 8, 8),
                      topk_weights=torch.ones(2, 1), topk_ids=torch.zeros(2, 1, dtype=torch.int32), activation="silu")
    with pytest.raises(ImportError, match=var):
        spec.experts(call)


@pytest.mark.skipif(not _EXAMPLES.is_dir(), reason="the examples/ folder is not beside an installed package")
def test_the_sglang_wrapper_hands_over_every_listed_slot():
    """vLLM's lora_ids (L + 1 entries, -1 first where tokens have no adapter) as SGLang's max_loras programs read
    them: the listed slots first, -1 after (passed as they were, the last active slot was never processed)."""
    import torch

    from moe_lora_harness.harness.spec.registry import load_attr
    convert = load_attr(str(_EXAMPLES / "sglang_wheel_op/sglang_wheel_op.py:_sglang_lora_ids"))
    ids = torch.tensor([-1, 0, 1, 2], dtype=torch.int32)
    assert convert(ids, torch.tensor([4]), 3).tolist() == [0, 1, 2]
    assert convert(torch.tensor([0, 2, -1, -1], dtype=torch.int32), torch.tensor([2]), 3).tolist() == [0, 2, -1]
    assert convert(ids, torch.tensor([2]), 3).tolist() == [0, -1, -1]      # only the first num_active_loras count
