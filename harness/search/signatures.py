"""A failure's signature: its class, and the axes (harness.draw.axes) its minimal case needs.

The class is the failure's kind (with the exception type and message head for a raise, the signal for a
crash); the needed axes are found by setting each of the case's unusual axes back to its plain value and
running it again (`needed_axes`). Two failures of one class whose cases agree on those axes are one bug.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from moe_lora_harness.harness.draw.axes import AXES, SIGNATURE_AXES, values_of
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.contract import BackendSpec, support_for
from moe_lora_harness.harness.execution.runner import WRONG_VALUE_KINDS, Outcome, run_case


def axes_of(case: Case) -> dict:
    """The axes a failure's signature is made of (values as short strings)."""
    return {name: str(v) for name, v in values_of(case, SIGNATURE_AXES).items()}


PLAIN = {level: axes_of(Case(level=level)) for level in ("op", "expert")}   # a case is compared with its level's


_CLASS_OF_KIND = {"timeout": "hang", "element": "per-element bound", "aggregate": "aggregate bound",
                  "nonfinite": "non-finite output", "untouched": "untouched element changed",
                  "not-neutral": "not neutral (a token without an adapter differs from the LoRA-disabled twin)",
                  "not-invariant": "not batch-invariant (a view of the case differs from the plain run)"}
VALUE_CLASSES = tuple(_CLASS_OF_KIND[k] for k in WRONG_VALUE_KINDS)   # the classes of wrong values


def same_class(a: str, b: str, semantics: str = "") -> bool:
    """Whether failure classes `a` and `b` are one: equal, or both wrong values of a named mistake (it fails
    per element on one shape, in aggregate or on untouched elements on another)."""
    return a == b or bool(semantics) and a in VALUE_CLASSES and b in VALUE_CLASSES


def failure_class(o: Outcome) -> str:
    """The failure's class: its kind, with the exception type and message head for a raise, the signal for a crash."""
    kind = o.kind or o.status
    if kind in ("raised", "declaration", "environment"):
        head = re.sub(r"\d+", "#", (o.message or "").split("\n", 1)[0])[:80]
        return f"{kind}: {head}"
    if kind == "crash":
        m = re.search(r"killed by (\w+)|exited with code (\d+)", o.detail or "")
        return f"crash: {m.group(0)}" if m else "crash"
    return _CLASS_OF_KIND.get(kind, kind)


@dataclass(frozen=True)
class Signature:
    """A distinct failure: its class, the axis values the minimal case needs, and the integration mistake its
    output follows (Outcome.semantics; '' when none was named)."""

    klass: str
    needs: tuple = ()          # ((axis, value), ...), sorted
    semantics: str = ""

    def matches(self, klass: str, axes: dict, semantics: str | None = None) -> bool:
        """Same class (for a named mistake, any class of wrong values: `same_class`) and needed axes; and the
        same named mistake when `semantics` is known (an undiagnosed outcome, as the search runs them, passes
        None)."""
        return (same_class(self.klass, klass, self.semantics) and all(axes.get(k) == v for k, v in self.needs)
                and (semantics is None or semantics == self.semantics))

    def fits(self, klass: str, case: Case, semantics: str | None = None) -> bool:
        """Whether a failure of class `klass` on `case` (named `semantics`, when known) is this one."""
        return self.matches(klass, axes_of(case), semantics)

    @property
    def text(self) -> str:
        return (self.klass + (f", consistent with {self.semantics}" if self.semantics else "")
                + (" | needs " + ", ".join(f"{k}={v}" for k, v in self.needs) if self.needs else ""))

    @property
    def key(self) -> str:
        return hashlib.sha1(self.text.encode()).hexdigest()[:10]


def every_axis(case: Case) -> tuple:
    """All the case's axes as needs: the signature of a failure whose axes could not be tried."""
    return tuple(sorted(axes_of(case).items()))


def needed_axes(spec: BackendSpec, o: Outcome, device: str, executor, reruns: int = 0) -> tuple:
    """The axes the failing case needs: each axis off its plain value is set back to it (Axis.plain); if the
    case then passes (or fails another way) the failure needs that axis. An axis that cannot be set back (the
    case is then malformed or not claimed) counts as needed."""
    case, klass = o.case, failure_class(o)
    plain = PLAIN[case.level]
    needs = []
    for axis, value in sorted(axes_of(case).items()):
        flip = AXES[axis].plain
        if flip is None or plain.get(axis) == value:
            continue
        try:
            flipped = flip(case)
        except (TypeError, ValueError):
            flipped = None
        if flipped == case:          # implied by another axis (w2 has one slice and multiplies the weight)
            continue
        if flipped is None or flipped.problems() or not support_for(spec, flipped, device)[0]:
            needs.append((axis, value))
            continue
        again = run_case(spec, flipped, device, executor=executor, reruns=reruns, diagnose=False)
        if not (again.failed and same_class(klass, failure_class(again), o.semantics)):
            needs.append((axis, value))
    if ("which", "w2") in needs:     # every w2 case multiplies: the pair would match exactly what w2 alone does
        needs = [n for n in needs if n != ("mul_routed_weight", "True")]
    return tuple(needs)
