"""A backend with several independent planted bugs, for fuzz campaigns: one run must report each of them.

Op level, the reference op (one-shot rounding) with: the columns before `offset` zeroed (offset != 0); no
store when add_inputs=False; a ValueError for max_rank > 64; a crash (os._exit) when every token lacks an
adapter; a hang when the routed weight is multiplied and T == 7. `crash-and-hang`: only a crash and a hang.
"""
from __future__ import annotations

import os
import time

from moe_lora_harness.harness.spec.contract import BackendSpec, Capabilities
from moe_lora_harness.reference.lora_op import fused_moe_lora as _ref_op


def several_bugs(**kw):
    """The reference op with five independent defects (see the module doc)."""
    if int(kw["max_lora_rank"]) > 64:
        raise ValueError(f"rank {kw['max_lora_rank']} too large for this kernel")
    mapping = kw["token_lora_mapping"]
    if mapping.numel() and bool((mapping < 0).all()):
        os._exit(3)
    if kw.get("mul_routed_weight") and kw["output"].shape[0] == 7:
        time.sleep(3600)
    if not kw.get("add_inputs", True):
        return
    _ref_op(**kw, precision="one_shot")
    if kw.get("offset", 0):
        kw["output"][:, :, :kw["offset"]] = 0


def crash_and_hang(**kw):
    """The reference op, except: it exits when every token lacks an adapter, and hangs when add_inputs=False."""
    mapping = kw["token_lora_mapping"]
    if mapping.numel() and bool((mapping < 0).all()):
        os._exit(3)
    if not kw.get("add_inputs", True):
        time.sleep(3600)
    _ref_op(**kw, precision="one_shot")


CRASH_AND_HANG = BackendSpec(name="crash-and-hang", description=crash_and_hang.__doc__,
                             capabilities=Capabilities(levels=frozenset({"op"})), op=crash_and_hang,
                             precision="one_shot")
SEVERAL_BUGS = BackendSpec(name="several-bugs", description=several_bugs.__doc__,
                           capabilities=Capabilities(levels=frozenset({"op"})), op=several_bugs, precision="one_shot")
BACKENDS = [SEVERAL_BUGS, CRASH_AND_HANG]
