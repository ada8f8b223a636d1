"""moe-lora-harness's machinery, in rooms along the path a case takes: specified, drawn, built, judged, run under
supervision, searched, reported (docs/architecture.md draws it).

The harness knows backends only through `harness.spec.contract.BackendSpec` records.
"""
if __name__ != "moe_lora_harness.harness":   # one name per module (a checkout's folder is not a second package)
    raise ImportError(f"{__name__!r} is the package moe_lora_harness.harness: import it by that name")

# The rooms (subpackages) in the order a case meets them: each imports only rooms before it (suites/test_layering.py)
ROOMS = ("spec", "served", "draw", "build", "judge", "execution", "layer", "check", "search", "selftest", "front")
