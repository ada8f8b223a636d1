"""check's failures grouped: one block per (backend, kind, named mistake, message up to its numbers), with the
count, the first case's full report (CASE, REPRO) and the features of the rest, so that a backend that fails the
same way 64 times prints one report, not 64."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

# numbers (counts, ratios, shapes) differ from case to case in one and the same failure's message
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", re.IGNORECASE)


@dataclass
class FailureGroup:
    """The failures of one backend that share a kind and a message (up to its numbers)."""

    backend: str
    kind: str
    message: str                            # the first failure's message
    outcomes: list = field(default_factory=list)
    features: list = field(default_factory=list)

    @property
    def first(self):
        return self.outcomes[0]


def group_key(o) -> tuple:
    """What makes two failures one group: backend, kind, the mistake a semantic diagnosis named (two named
    mistakes are two groups), and the message with its numbers blanked."""
    return (o.backend, o.kind, o.semantics, _NUMBER.sub("#", o.message.strip()))


def group_failures(failures: list, feature_of) -> list[FailureGroup]:
    """The failing outcomes grouped by `group_key`, in the order of their first member."""
    groups: dict[tuple, FailureGroup] = {}
    for o in failures:
        g = groups.setdefault(group_key(o), FailureGroup(o.backend, o.kind, o.message))
        g.outcomes.append(o)
        feat = feature_of(o)
        if feat not in g.features:
            g.features.append(feat)
    return list(groups.values())


def limit_hint(spec) -> str:
    """How to declare a limit, for a backend whose failures are raises: a declared limit is reported as
    unsupported with its reason instead of failing."""
    from moe_lora_harness.harness.spec.registry import is_wrapped_function
    what = ("declare its limits in Capabilities (dtypes, layouts, max_rank, activations, quant, or a Rule with a "
            "reason); the cases it declines are then reported unsupported with that reason, not failed "
            "(README, 'Adding a backend')")
    if spec is not None and is_wrapped_function(spec):
        return ("HINT: if these raises are limits, not bugs: a plain function cannot declare them; wrap it in a "
                "BackendSpec (from moe_lora_harness import BackendSpec, Capabilities, Rule) and " + what)
    return "HINT: if these raises are limits, not bugs: " + what


def groups_text(groups: list[FailureGroup], specs: dict) -> str:
    """Each group once: its head line (count, backend, kind, message), the first case's report (CASE, REPRO),
    the features of the others, and for raises the hint on declaring a limit."""
    blocks = []
    for i, g in enumerate(groups, 1):
        n = len(g.outcomes)
        head = f"FAILURE GROUP {i} of {len(groups)}: {g.backend}: {n} case(s), kind {g.kind}: {g.message[:300]}"
        lines = [head, g.first.detail]
        if n > 1:
            lines.append(f"... and {n - 1} more case(s) failing the same way (the same kind and message up to "
                         f"its numbers), in: {', '.join(g.features)}; every case and REPRO is in --json")
        if g.kind == "raised":     # perhaps what it lacks, raised instead of declared
            lines.append(limit_hint(specs.get(g.backend)))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
