"""Backends that need an environment (test material for BackendSpec.setup / --setup and environment failures).

`needs-group` checks a stand-in for a framework's parallel state, as vLLM's op checks its tensor-parallel
group, and then runs the reference op; `init_group` is the setup that provides it; `broken_setup` raises.
"""
from __future__ import annotations

from moe_lora_harness.harness.spec.contract import BackendSpec, Capabilities
from moe_lora_harness.reference.lora_op import fused_moe_lora as _ref_op

STATE = {"group": False, "setups": 0}


def init_group():
    """The setup: a single-rank 'group' (counts how often it ran in this process)."""
    STATE["group"] = True
    STATE["setups"] += 1


def broken_setup():
    raise RuntimeError("no GPU topology file")


def needs_group(**kw):
    """The reference op, behind a framework-style environment check."""
    if not STATE["group"]:
        raise AssertionError("tensor model parallel group is not initialized")
    _ref_op(**kw, precision="one_shot")


_CAPS = Capabilities(levels=frozenset({"op"}))
NEEDS_GROUP = BackendSpec(name="needs-group", description=needs_group.__doc__, capabilities=_CAPS, op=needs_group)
WITH_SETUP = BackendSpec(name="needs-group-with-setup", description="needs-group, declaring its setup",
                         capabilities=_CAPS, op=needs_group, setup=init_group)
BROKEN = BackendSpec(name="needs-group-broken-setup", description="a setup that raises", capabilities=_CAPS,
                     op=needs_group, setup=broken_setup)
BACKENDS = [NEEDS_GROUP, WITH_SETUP, BROKEN]
