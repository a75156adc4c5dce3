"""What a property is called, and which check re-runs it: the one place that builds and reads its name.

A property's name is ``KIND[-DETAIL][LABEL]``: ``differential-any-config[fast-interpret-v6e]``,
``validation[num_seqs-too-large #0]``. The kind says which check ``rpa_harness.checks.recheck`` runs; the
detail says which variant of it (the strategy, the bucket and corner); the label where it ran (the backend's
label) or, for a validation property, which rule and variant. Repros store the kind apart from the name
(``repro.SCHEMA``); a repro written before that has its name parsed here.
"""

import dataclasses

from rpa_harness.strategies.buckets import LARGE_BUCKETS

DIFFERENTIAL = "differential"  # the kernel's output against the float64 oracle, under the tolerance
VALIDATION = "validation"  # an invalid input raises the specified ValueError with its exact message
PADDING = "padding-isolation"  # valid rows do not change with what the padding holds
DETERMINISM = "determinism"  # two identical calls give the same bits
COMPILATION = "compiles"  # the kernel compiles for a TPU generation (ahead of time, never called)
KINDS = (DIFFERENTIAL, VALIDATION, PADDING, DETERMINISM, COMPILATION)


@dataclasses.dataclass(frozen=True)
class PropertyName:
    kind: str  # one of KINDS, or a kind a target declares (its RPA_HARNESS_PROPERTIES)
    detail: str = ""  # e.g. "any-config", "long-packed-past-2to15-own-blocks"
    label: str = ""  # e.g. the backend's label "fast-interpret-v6e", or "num_seqs-too-large #0"

    def __post_init__(self):
        if not self.kind or "[" in self.kind:
            raise ValueError(f"a property kind is a non-empty name without '[', not {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.kind}{'-' + self.detail if self.detail else ''}[{self.label}]"


def parse(name: str) -> PropertyName:
    """The structured name of ``str(PropertyName(...))``. A name no built-in kind starts is a target's own
    kind, whole (``v3-attention-and-cache[interpret]``); ValueError for a name without a kind."""
    head, bracket, rest = name.partition("[")
    label = rest[:-1] if bracket and rest.endswith("]") else rest
    for kind in sorted(KINDS, key=len, reverse=True):  # "padding-isolation" before any shorter prefix
        if head == kind or head.startswith(kind + "-"):
            return PropertyName(kind, head[len(kind) + 1 :], label)
    if not head:
        raise ValueError(f"not a property name: {name!r} (expected KIND[-DETAIL][LABEL])")
    return PropertyName(head, "", label)


def large_bucket(name: str) -> str | None:
    """The large bucket (long, production) whose property ``name`` is (its detail starts with the bucket), or
    None: the known-issue replay keeps such a repro off the checking interpreter, as its property does."""
    detail = parse(name).detail
    return next(
        (bucket for bucket in LARGE_BUCKETS if detail == bucket or detail.startswith(f"{bucket}-")), None
    )
