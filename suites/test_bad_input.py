"""Bad input gets a clear error naming the argument, before any kernel runs, for every op backend and
for the reference itself; never a crash deep in a kernel and never a silently wrong answer."""
from __future__ import annotations

import pytest
import torch

from moe_lora_harness.harness.front.pytest_plugin import selected_backends, selected_device
from moe_lora_harness.harness.build.builders import build_op_inputs
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.reference.lora_op import fused_moe_lora as reference_op

BASE = Case(T=4, H=32, I=24, E=4, top_k=2, max_loras=2, max_rank=8, dtype="float16", seed=3)


def _mutations():
    """(name, case, mutate(kwargs) -> kwargs, argument the message must name)."""
    naive = BASE.replace(layout="naive")
    w2 = BASE.replace(which="w2", num_slices=1, mul_routed_weight=True)

    def setk(**ch):
        return lambda kw: dict(kw, **ch)

    def lists(key, fn):
        return lambda kw: dict(kw, **{key: [fn(t) for t in kw[key]]})

    return [
        ("output-2d", BASE, lambda kw: dict(kw, output=kw["output"][:, 0]), "output"),
        ("output-int", BASE, lambda kw: dict(kw, output=kw["output"].to(torch.int32)), "output"),
        ("output-pairs-not-collapsible", BASE,
         lambda kw: dict(kw, output=torch.randn(kw["output"].shape[1], kw["output"].shape[0],
                                                kw["output"].shape[2]).to(kw["output"].dtype).transpose(0, 1)),
         "output"),
        ("x-dtype", BASE, lambda kw: dict(kw, qcurr_hidden_states=kw["qcurr_hidden_states"].float()),
         "qcurr_hidden_states"),
        ("x-rows", BASE, lambda kw: dict(kw, qcurr_hidden_states=kw["qcurr_hidden_states"][:-1]),
         "qcurr_hidden_states"),
        ("x-width", BASE, lambda kw: dict(kw, qcurr_hidden_states=kw["qcurr_hidden_states"][:, :-1]),
         "qcurr_hidden_states"),
        ("w2-x-rows-not-pairs", w2, lambda kw: dict(kw, qcurr_hidden_states=kw["qcurr_hidden_states"][:4]),
         "qcurr_hidden_states"),
        ("lora-a-dtype", BASE, lists("lora_a_stacked", lambda t: t.float()), "lora_a_stacked"),
        ("lora-b-dtype", BASE, lists("lora_b_stacked", lambda t: t.float()), "lora_b_stacked"),
        ("lora-a-3d", BASE, lists("lora_a_stacked", lambda t: t[0]), "lora_a_stacked"),
        ("slice-count-mismatch", BASE, lambda kw: dict(kw, lora_b_stacked=kw["lora_b_stacked"][:1]),
         "lora_b_stacked"),
        ("no-slices", BASE, lambda kw: dict(kw, lora_a_stacked=[], lora_b_stacked=[]), "lora_a_stacked"),
        ("rank-mismatch-a-b", BASE, lists("lora_b_stacked", lambda t: t[..., :-1]), "lora_b_stacked"),
        ("output-too-narrow", BASE, lambda kw: dict(kw, output=kw["output"][:, :, :-1]), "output"),
        ("top-k-mismatch", BASE, setk(top_k_num=3), "top_k_num"),
        ("topk-weights-rows", BASE, lambda kw: dict(kw, topk_weights=kw["topk_weights"][:-1]), "output"),
        ("mapping-dtype", BASE, lambda kw: dict(kw, token_lora_mapping=kw["token_lora_mapping"].long()),
         "token_lora_mapping"),
        ("mapping-out-of-range", naive,
         lambda kw: dict(kw, token_lora_mapping=torch.full_like(kw["token_lora_mapping"], 7)), "token_lora_mapping"),
        ("expert-id-out-of-range", naive,
         lambda kw: dict(kw, expert_ids=torch.full_like(kw["expert_ids"], 99)), "expert_ids"),
        ("sorted-ids-dtype", BASE, lambda kw: dict(kw, sorted_token_ids=kw["sorted_token_ids"].long()),
         "sorted_token_ids"),
        ("sorted-missing-ntpp", BASE, setk(num_tokens_post_padded=None), "num_tokens_post_padded"),
        ("naive-expert-ids-2d", naive, lambda kw: dict(kw, expert_ids=kw["expert_ids"].view(2, -1)), "expert_ids"),
        ("block-size-not-pow2", BASE, setk(shrink_block_size_m=24), "shrink_block_size_m"),
        ("negative-offset", BASE, setk(offset=-1), "offset"),
        ("x-on-another-device", BASE,
         lambda kw: dict(kw, qcurr_hidden_states=kw["qcurr_hidden_states"].to("meta")), "qcurr_hidden_states"),
        ("lora-b-on-another-device", BASE, lists("lora_b_stacked", lambda t: t.to("meta")), "lora_b_stacked"),
        ("adapter-enabled-dtype", BASE, lambda kw: dict(kw, adapter_enabled=kw["adapter_enabled"].bool()),
         "adapter_enabled"),
    ]


MUTATIONS = {m[0]: m for m in _mutations()}
# Not errors for the reference, which is an oracle rather than a kernel: it reads output through
# strides (vLLM's two-kernel path does too; only kernels flattening (T, k) need it collapsible), accepts
# any integer id dtype, and follows vLLM's rule that a LoRA id >= L is skipped. Kernels reject these.
KERNEL_ONLY = {"output-pairs-not-collapsible", "mapping-dtype", "mapping-out-of-range", "sorted-ids-dtype"}


def pytest_generate_tests(metafunc):
    if "target" in metafunc.fixturenames:
        device = selected_device(metafunc.config)
        names = ["reference"] + sorted(n for n, s in selected_backends(metafunc.config).items()
                                       if s.op is not None and "op" in s.capabilities.levels)
        params = [(n, m) for n in names for m in MUTATIONS]
        metafunc.parametrize(("target", "mutation"), params, ids=[f"{n}/{m}" for n, m in params])


def test_valid_baseline_runs(backends, device):
    """The unmutated inputs are accepted by every claiming backend (so the errors below are the mutation's);
    it fails if no selected op backend claims any of them (every bad-input test would then be a skip)."""
    from moe_lora_harness.harness.spec.contract import support_for
    ran, declined = [], []
    for name, spec in backends.items():
        if spec.op is None:
            continue
        for case in {m[1] for m in MUTATIONS.values()}:
            ok, why = support_for(spec, case, device)
            if not ok:
                declined.append(f"{name}: {why}")
                continue
            spec.op(**build_op_inputs(case, device).call_kwargs())
            ran.append(name)
    assert ran, f"no selected op backend claims a bad-input base case on {device}, so nothing here is tested: {declined}"


def test_bad_input_is_named(target, mutation, backends, device):
    name, case, mutate, arg = MUTATIONS[mutation]
    if target == "reference":
        if mutation in KERNEL_ONLY:
            pytest.skip("a kernel-only requirement (see KERNEL_ONLY)")
        fn, dev = reference_op, "cpu"
    else:
        from moe_lora_harness.harness.spec.contract import support_for
        spec = backends[target]
        ok, why = support_for(spec, case, device)
        if not ok:
            pytest.skip(f"unsupported by {target}: {why}")
        fn, dev = spec.op, device
    kw = mutate(build_op_inputs(case, dev).call_kwargs())
    before = kw["output"].clone() if torch.is_tensor(kw["output"]) else None
    with pytest.raises((ValueError, TypeError)) as info:
        fn(**kw)
    assert arg in str(info.value), f"error for {mutation} does not name {arg!r}: {info.value}"
    if before is not None and before.dtype.is_floating_point:
        assert torch.equal(kw["output"].view(torch.uint8), before.view(torch.uint8)), \
            "output was modified before the error was raised"
