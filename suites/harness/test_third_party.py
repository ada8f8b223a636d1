"""A stranger's kernel gets a true verdict: what the CPU interpreter cannot compute is reported as not runnable
(never a pass or a failure), precision may depend on the device, a REPRO carries every path entry the backend
needs, probing leaves a trace, the matrix shows only the levels a backend has, the corpus lives in the cache,
-0.0 and subnormal sums reach the kernels, and a declared layout limit carries its reason."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from moe_lora_harness import BackendSpec, Capabilities, Case
from moe_lora_harness.harness.front import cli
from moe_lora_harness.harness.build.builders import build_op_inputs
from moe_lora_harness.harness.spec.contract import support_for
from moe_lora_harness.harness.execution.device import interpreting
from moe_lora_harness.harness.execution.execute import InProcess
from moe_lora_harness.harness.check.features import FEATURES
from moe_lora_harness.harness.spec.registry import load_ref
from moe_lora_harness.harness.check.report import build_matrix, to_text
from moe_lora_harness.harness.execution.runner import expectations, run_case

SIG = ("output, qcurr_hidden_states, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids, expert_ids, "
       "num_tokens_post_padded, token_lora_mapping, max_lora_rank, top_k_num, lora_ids, num_active_loras, "
       "adapter_enabled, shrink_block_size_m, shrink_block_size_n, shrink_block_size_k, shrink_group_size_m, "
       "shrink_num_warps, shrink_num_stages, shrink_split_k, expand_block_size_m, expand_block_size_n, "
       "expand_block_size_k, expand_group_size_m, expand_num_warps, expand_num_stages, expand_split_k, "
       "mul_routed_weight=False, fully_sharded=False, offset=0, add_inputs=True")
# a third party's module: plain functions with vLLM's signature, loaded by file as `--backend file.py:attr`
STRANGER = textwrap.dedent(f"""
    import torch
    import triton
    import triton.language as tl
    from moe_lora_harness.kernels.eager import fused_moe_lora as _eager
    from moe_lora_harness.kernels.triton.lora_op import fused_moe_lora as triton_op


    @triton.jit
    def _copy_ids(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


    def ids_in_triton_math_in_torch({SIG}):
        # a Triton kernel that only moves int32 ids; the arithmetic is torch's, right in every dtype
        ids = torch.empty_like(token_lora_mapping)
        _copy_ids[(1,)](token_lora_mapping, ids, ids.numel(), BLOCK=max(16, triton.next_power_of_2(ids.numel())))
        kw = dict(locals())
        kw.pop("ids")
        kw["token_lora_mapping"] = ids
        _eager(**kw)


    def adds_zero_everywhere({SIG}):
        # right where it writes, but it also adds 0 to every element it must leave alone: -0.0 becomes +0.0
        _eager(**dict(locals()))
        output.add_(0.0)
""")


@pytest.fixture(scope="module")
def stranger(tmp_path_factory):
    path = tmp_path_factory.mktemp("stranger") / "stranger_ops.py"
    path.write_text(STRANGER)
    return {name: load_ref(f"{path}:{name}")[0] for name in ("triton_op", "ids_in_triton_math_in_torch",
                                                              "adds_zero_everywhere")}


# Triton kernels run in the interpreter here (no CUDA): bf16 results say nothing; on a GPU they are compiled
INTERPRETED = interpreting()


def test_a_wrapped_triton_op_in_bf16_on_the_interpreter_is_not_runnable_never_a_verdict(stranger, device):
    """In the interpreter: not-runnable, with the reason and the kernel; compiled on a GPU: judged (a pass)."""
    spec = stranger["triton_op"]
    assert spec.capabilities.dtypes["cpu"] >= {"bfloat16"}          # a plain function claims everything
    o = run_case(spec, Case(T=5, dtype="bfloat16"), device, executor=InProcess())
    if INTERPRETED:
        assert o.status == "not-runnable" and not o.failed and "11584" in o.reason and "_one_shot_kernel" in o.reason
    else:
        assert o.status == "pass", o.detail
    assert run_case(spec, Case(T=5, dtype="float16"), device, executor=InProcess()).status == "pass"
    assert run_case(spec, Case(T=5, dtype="float32"), device, executor=InProcess()).status == "pass"


def test_a_declared_backend_probed_in_bf16_is_not_runnable_either(device):
    [spec] = [s for s in load_ref("moe_lora_harness.backends:BUILTINS") if s.name == "triton_one_shot"]
    case = Case(T=5, dtype="bfloat16")
    declared = run_case(spec, case, device).status
    probed = run_case(spec, case, device, probe=True, executor=InProcess()).status
    assert (declared, probed) == (("unsupported", "not-runnable") if INTERPRETED else ("pass", "pass"))


def test_kernels_that_compute_nothing_in_the_dtype_are_judged(stranger, device):
    """Only an interpreted launch on a bf16 tensor withholds the verdict: int32-only kernels do not."""
    o = run_case(stranger["ids_in_triton_math_in_torch"], Case(T=5, dtype="bfloat16"), device, executor=InProcess())
    assert o.status == "pass", o.detail


def test_precision_may_depend_on_the_device():
    spec = BackendSpec("dev", "d", Capabilities(), op=lambda **kw: None,
                       precision={"cpu": "one_shot", "cuda": lambda case: "one_shot_tf32"})
    case = Case(dtype="float32")
    assert spec.precision_for(case, "cpu") == "one_shot"
    assert spec.precision_for(case, "cuda:1") == "one_shot_tf32"
    assert expectations(spec, case, "cpu").precision == "one_shot"
    only_gpu = BackendSpec("g", "d", Capabilities(), op=lambda **kw: None, precision={"cuda": "one_shot"})
    with pytest.raises(ValueError, match="no rounding model for device cpu"):
        only_gpu.precision_for(case, "cpu")
    assert run_case(only_gpu, case, "cpu").kind == "declaration"        # the declaration's fault, said so


def test_a_repro_carries_every_path_entry_the_backend_module_imports_from(tmp_path):
    """mymod (on one PYTHONPATH entry) imports helper (on another): the REPRO names both and replays the failure
    from a fresh shell elsewhere."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "helper.py").write_text("FACTOR = 1.5\n")
    (tmp_path / "a" / "mymod.py").write_text(textwrap.dedent(f"""
        from helper import FACTOR
        from moe_lora_harness.kernels.eager import fused_moe_lora as _eager

        def my_op({SIG}):
            kw = dict(locals())
            kw["lora_b_stacked"] = [b * FACTOR for b in lora_b_stacked]
            _eager(**kw)
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b")]
                                                      + os.environ.get("PYTHONPATH", "").split(os.pathsep)).strip(os.pathsep))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    first = subprocess.run([sys.executable, "-m", "moe_lora_harness", "replay", "--backend", "mymod:my_op",
                            "--only", "my_op", "--device", "cpu", "--repeat", "1", "--in-process", "--case",
                            '{"T": 3}'],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 1, first.stdout[-2000:] + first.stderr[-2000:]
    repro = next(l for l in first.stdout.splitlines() if l.startswith("REPRO: ")).removeprefix("REPRO: ")
    assert str(tmp_path / "a") in repro and str(tmp_path / "b") in repro, repro
    (tmp_path / "elsewhere").mkdir()
    fresh = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    again = subprocess.run(["bash", "-c", repro + " --in-process"], cwd=tmp_path / "elsewhere", env=fresh,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 1 and "FAIL backend=my_op" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]


def test_probing_keeps_a_trace_of_declined_cases_that_fail(device):
    [spec] = [s for s in load_ref("moe_lora_harness.backends:BUILTINS") if s.name == "triton_small_batch"]
    case = Case(T=3, layout="sorted")                    # declined: the small-batch kernel takes the naive layout
    o = run_case(spec, case, device, probe=True, executor=InProcess(), reruns=0)
    assert o.status == "unsupported" and o.probed and o.kind == "raised" and o.message
    matrix = build_matrix([o], lambda _: "sorted layout")
    cell = matrix["triton_small_batch"]["sorted layout"]
    assert cell["probed_failing"] == {"raised": 1} and case.to_json() in cell["probed_messages"][0]
    assert "failing as declared" in to_text(matrix, ["sorted layout"])


def test_an_op_only_backend_gets_no_expert_rows(capsys):
    rc = cli.main(["check", "--backend", "moe_lora_harness.kernels.eager:fused_moe_lora", "--only", "fused_moe_lora",
                   "--feature", "bf16", "--cases-per-feature", "1", "--in-process"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "experts: bf16" not in out and "\nbf16 " in out


def test_the_fuzz_corpus_lives_in_the_cache_not_the_working_directory(tmp_path, monkeypatch):
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("MOE_LORA_HARNESS_CACHE", str(cache))
    rc = cli.main(["fuzz", "--backend", "moe_lora_harness.harness.selftest.mutants:MUTANTS", "--only", "mutant-drops-slice",
                   "--max-examples", "20", "--seed", "2", "--in-process", "--reruns", "0", "-q"])
    assert rc == 1
    assert list(work.iterdir()) == [], list(work.iterdir())
    [corpus] = (cache / "corpus").glob("mutant-drops-slice-op-*")      # keyed by name, level and origin
    assert [json.loads(p.read_text())["case"] for p in corpus.glob("*.json")]


def test_inputs_hold_negative_zeros_and_untouched_ones_must_keep_their_sign(stranger):
    case = Case(T=6, mapping="mixed", offset=5, which="w2", num_slices=1, mul_routed_weight=True)
    inp = build_op_inputs(case)
    for t in (inp.output, inp.x):
        negzero = (t == 0) & torch.signbit(t)
        assert 0 < int(negzero.sum()) < t.numel()
    o = run_case(stranger["adds_zero_everywhere"], case, "cpu", executor=InProcess(), reruns=0)
    assert o.failed and o.kind == "untouched", o.detail


def test_subnormal_sums_row_catches_a_flush_to_zero_op_that_accumulates(device):
    [row] = [f for f in FEATURES if f.name.startswith("op: subnormal sums")]
    [case] = row.cases(device, 1)
    assert case.add_inputs and case.magnitude < 2.0 ** -14
    inp = build_op_inputs(case)
    assert float(inp.output.abs().max()) < 2.0 ** -14            # the prior values are subnormal-scale too
    mutants = {s.name: s for s in load_ref("moe_lora_harness.harness.selftest.reach_mutants:REACH_MUTANTS")}
    assert run_case(mutants["reach-subnormal-flush"], case, device, executor=InProcess(), reruns=0).kind == "element"
    assert run_case(mutants["reach-control"], case, device, executor=InProcess()).status == "pass"


def test_a_declared_layout_limit_says_why():
    caps = Capabilities(layouts=frozenset({"naive"}), reasons={("layout", "sorted"): "one program per pair"})
    spec = BackendSpec("n", "d", caps, op=lambda **kw: None)
    ok, why = support_for(spec, Case(layout="sorted"), "cpu")
    assert not ok and why.endswith("one program per pair") and "sorted block assignment" in why


def test_device_cpu_on_a_cuda_host_runs_triton_in_the_interpreter(monkeypatch):
    """Compiled Triton kernels cannot read CPU tensors: --device cpu on a GPU host interprets them (else every
    correct Triton backend would fail there); --device cuda leaves them compiled."""
    from moe_lora_harness.harness.execution import device as dev
    monkeypatch.setattr(dev, "cuda_present", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")     # recorded, so the switch below is undone after the test
    monkeypatch.delenv("TRITON_INTERPRET")
    assert dev.prepare_device("cuda") == "cuda" and "TRITON_INTERPRET" not in os.environ
    assert dev.prepare_device("cpu") == "cpu" and os.environ["TRITON_INTERPRET"] == "1"


@pytest.mark.parametrize("before", [None, "1"], ids=["unset", "set"])
def test_the_interpreter_switch_is_kept_across_a_block_that_turns_it_on(monkeypatch, before):
    """A GPU host (unset) keeps compiled kernels after an in-process --device cpu; a CPU host (set) keeps its
    interpreter after a block that clears it."""
    from moe_lora_harness.harness.execution import device as dev
    monkeypatch.setattr(dev, "cuda_present", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("TRITON_INTERPRET")
    if before is not None:
        monkeypatch.setenv("TRITON_INTERPRET", before)
    with dev.interpreter_switch_kept():
        dev.prepare_device("cpu") if before is None else os.environ.pop("TRITON_INTERPRET")
        assert os.environ.get("TRITON_INTERPRET") != before
    assert os.environ.get("TRITON_INTERPRET") == before


@pytest.mark.interpreter_as_is
def test_a_watched_call_interprets_integers_as_compiled_kernels_do():
    """Compiled without debug, Triton's overflow checks are no code; the interpreter runs them on every int32
    op (a quarter of its time here) and then drops their assert (its options have no debug): an overflow passes
    silently either way, with the same bits. A watched call turns them off, and restores them after."""
    if not INTERPRETED:
        pytest.skip("compiled kernels here: the interpreter's options are not used")
    import triton
    import triton.language as tl
    from triton.runtime import interpreter
    from moe_lora_harness.harness.execution.interpreter import LaunchWatch

    @triton.jit
    def times(x_ptr, out_ptr, m):
        tl.store(out_ptr, tl.load(x_ptr) * m)

    def overflowing() -> int:
        x, out = torch.tensor([2 ** 30 + 3], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        times[(1,)](x, out, 4)          # 2^32 + 12 wraps to 12
        return int(out)

    before = interpreter.interpreter_builder.options
    assert before.sanitize_overflow and not before.debug
    assert overflowing() == 12
    with LaunchWatch():
        assert interpreter.interpreter_builder.options.sanitize_overflow is False
        assert overflowing() == 12
    assert interpreter.interpreter_builder.options is before


@pytest.mark.interpreter_as_is
def test_a_watched_launch_patches_the_language_once_and_computes_the_same():
    """The interpreter re-patches triton.language at every @triton.jit helper call inside a kernel; a watched
    launch patches each language module once. Checked both ways on a kernel with helpers (a real patch per
    launch, plus one per other module, when watched; one per helper call when not), and the same bits."""
    if not INTERPRETED:
        pytest.skip("compiled kernels here: the interpreter does not patch the language")
    from triton.runtime import interpreter
    from moe_lora_harness.harness.execution.interpreter import LaunchWatch
    original = interpreter._patch_lang
    calls = []

    def counting(fn):
        calls.append(fn.__name__)
        return original(fn)

    [spec] = [s for s in load_ref("moe_lora_harness.backends:BUILTINS") if s.name == "triton_one_shot"]
    case = Case(T=5, H=32, I=24, E=4, top_k=2, max_rank=8, dtype="float32", seed=3)
    outputs = []
    for watched in (True, False):
        calls.clear()
        interpreter._patch_lang = counting
        try:
            kw = build_op_inputs(case).call_kwargs()
            if watched:
                with LaunchWatch() as w:
                    spec.op(**kw)
                launches = len(w.launches)
            else:
                spec.op(**kw)
        finally:
            interpreter._patch_lang = original
        outputs.append(kw["output"].clone())
        if watched:
            # the launch's own patch, and one for a helper whose globals name another language module (tl.core)
            assert launches >= 1 and calls[0] == "_one_shot_kernel" and len(calls) <= 2 * launches, calls
        else:
            assert len(calls) > 2 * launches, "the unwatched interpreter patches at every helper call"
    assert torch.equal(outputs[0].view(torch.int32), outputs[1].view(torch.int32))


@pytest.mark.interpreter_as_is
def test_a_watched_call_maps_every_dtype_as_the_interpreter_does_and_restores_the_map():
    """The interpreter builds its Triton-to-NumPy dtype table at every call (2.5 % of the CPU suite's time); a
    watched call reads a memo: the same answer for every dtype, block and pointer type, and an unknown dtype still
    raises; Triton's own function is back after."""
    if not INTERPRETED:
        pytest.skip("compiled kernels here: the interpreter's dtype map is not used")
    import triton.language as tl
    from triton.runtime import interpreter
    from moe_lora_harness.harness.execution.interpreter import LaunchWatch
    original = interpreter._get_np_dtype
    scalars = [getattr(tl, n) for n in ("int1", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                                        "float16", "bfloat16", "float32", "float64", "float8e4nv", "float8e5")]
    kinds = scalars + [tl.pointer_type(t) for t in scalars] + [tl.block_type(t, [4, 8]) for t in scalars] + [
        tl.block_type(tl.pointer_type(tl.float16), [16])]
    with LaunchWatch():
        memo = interpreter._get_np_dtype
        assert memo is not original
        for _ in range(2):                              # a miss, then the memo
            assert [memo(t) for t in kinds] == [original(t) for t in kinds]
        with pytest.raises(KeyError):
            memo(tl.void)
    assert interpreter._get_np_dtype is original


@pytest.mark.interpreter_as_is
def test_a_scalar_of_the_interpreter_is_an_index_under_any_numpy():
    """Triton 3.6's interpreter held a scalar as a 1-element array and int() of it, which NumPy 2.4 refuses: every
    interpreted loop over a runtime bound raised and a correct backend failed check (seen with the H200 host's
    Triton 3.6). A watched launch converts it as Triton 3.9 does; a block is still no index."""
    import types

    import numpy as np

    from moe_lora_harness.harness.execution.interpreter import _one_element_index
    assert _one_element_index(types.SimpleNamespace(handle=types.SimpleNamespace(data=np.array([43], np.int32)))) == 43
    assert _one_element_index(types.SimpleNamespace(handle=types.SimpleNamespace(data=np.array(7)))) == 7
    with pytest.raises(ValueError):
        _one_element_index(types.SimpleNamespace(handle=types.SimpleNamespace(data=np.arange(2))))
