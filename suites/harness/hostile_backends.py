"""Hostile op backends: each misbehaves in one way a stranger's kernel can, to prove the runner survives it.

They wrap the reference op (one-shot rounding, so without their misbehaviour they would pass), and
misbehave only on cases with `mul_routed_weight` (the "w2" features), so a `check` run over them still
has passing cells to keep. Load them as `--backend moe_lora_harness.suites.harness.hostile_backends:HOSTILE`.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

from moe_lora_harness.harness.spec.contract import BackendSpec, Capabilities
from moe_lora_harness.reference.lora_op import fused_moe_lora as _ref_op

_calls = {"n": 0}


def _correct(kw):
    _ref_op(**kw, precision="one_shot")


def _hostile(name, doc, act, always=False):
    def op(**kw):
        if always or kw.get("mul_routed_weight"):
            act(kw)
        else:
            _correct(kw)
    op.__name__ = name.replace("-", "_")
    return BackendSpec(name=f"hostile-{name}", description=doc, capabilities=Capabilities(levels=frozenset({"op"})),
                       op=op, precision="one_shot")


def _system_exit(kw):
    raise SystemExit(0)


def _keyboard_interrupt(kw):
    raise KeyboardInterrupt


def _os_exit(kw):
    print("hostile: calling os._exit(3)", flush=True)
    os._exit(3)


def _abort(kw):
    os.abort()


def _segfault(kw):
    sys.stderr.flush()
    ctypes.string_at(0)          # reads address 0: SIGSEGV


def _hang(kw):
    marker = os.environ.get("HOSTILE_HANG_MARKER")
    if marker:                   # tells a test that the hang is in flight
        open(marker, "w").close()
    while True:                  # ignores signals a Python-level timeout could use
        time.sleep(0.05)


def _sigkill_self(kw):
    os.kill(os.getpid(), signal.SIGKILL)   # what an OOM killer does


def _writes(name):
    def act(kw):
        _correct(kw)
        t = kw[name][0] if isinstance(kw[name], list) else kw[name]
        t.view(-1)[0:1] += 1 if not t.is_floating_point() else 0.5
    return act


def _flips(kw):
    """Right on even calls, wrong on odd ones: the outcome of one case changes between runs."""
    _calls["n"] += 1
    _correct(kw)
    if _calls["n"] % 2 == 0:
        kw["output"].mul_(1.5)


def _reads_past_x(kw):
    """A read one element past x's end (a tile's tail without its mask), weighted by 0 as a masked product is."""
    x = kw["qcurr_hidden_states"]
    past = x.as_strided((x.numel() + 1,), (1,), x.storage_offset())[-1]
    _correct({**kw, "qcurr_hidden_states": x + 0 * past})


def _writes_past_output(kw):
    """A correct call, then one element stored past the output's end (a store without its tail mask)."""
    _correct(kw)
    o = kw["output"]
    o.as_strided((o.numel() + 1,), (1,), o.storage_offset())[-1] = 0


HOSTILE = [
    _hostile("control", "no misbehaviour: the reference op", lambda kw: _correct(kw)),
    _hostile("system-exit", "raises SystemExit(0) (a false pass if it reached the harness's exit)", _system_exit),
    _hostile("keyboard-interrupt", "raises KeyboardInterrupt from inside the backend", _keyboard_interrupt),
    _hostile("os-exit", "ends its process with os._exit(3)", _os_exit),
    _hostile("abort", "aborts its process (SIGABRT)", _abort),
    _hostile("segfault", "dereferences NULL (SIGSEGV)", _segfault),
    _hostile("sigkill", "is killed with SIGKILL (as by the OOM killer)", _sigkill_self),
    _hostile("hang", "never returns", _hang),
    _hostile("writes-x", "adds 0.5 to x (qcurr_hidden_states) after a correct call", _writes("qcurr_hidden_states")),
    _hostile("writes-lora-a", "adds 0.5 to lora_a_stacked[0] after a correct call", _writes("lora_a_stacked")),
    _hostile("writes-topk-weights", "adds 0.5 to topk_weights after a correct call", _writes("topk_weights")),
    _hostile("writes-expert-ids", "adds 1 to expert_ids after a correct call", _writes("expert_ids")),
    _hostile("reads-past-x", "reads one element past x's end (times 0, as a masked tile's product)", _reads_past_x),
    _hostile("writes-past-output", "stores one element past the output's end after a correct call",
             _writes_past_output),
    _hostile("nondeterministic", "right on even calls, 1.5x the output on odd ones", _flips, always=True),
]
BY_NAME = {s.name: s for s in HOSTILE}
