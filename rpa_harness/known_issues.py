"""Known issues: documented discrepancies a target still has, kept out of the draw until they are fixed.

Each entry names a discrepancy (its folder under a findings directory such as ``docs/upstream-findings/``),
says in one line what goes wrong, points at its repro pair and carries a predicate on a ``Case`` that is
true exactly when the case can trigger it, as narrow as the cause, so that the rest of the space stays
tested. The entries and their predicates belong to the target whose kernel has them (its module under
``rpa_harness.targets``, ``RPA_HARNESS_CATALOGUE``); a target declares the issues it still has with
``RPA_HARNESS_KNOWN_ISSUES`` (names or entries; ``--rpa-known-issues`` overrides it). The strategies then
move a drawn case that matches a declared issue to the nearest case outside it (``KnownIssue.avoid``), and
``tests/properties/test_known_issues.py`` replays each declared issue's repro: while it still fails the issue
is an expected failure, once it passes the run fails until the entry is removed.

A failure names the catalogued issues that fit it ("known issues this case matches"): those whose
predicate matches its case, that fail as its kind (``fails_as``: a halt for a halt, wrong outputs for
outputs over the bound) and whose kernel takes its case's API (``Kernel``). Only those: a user who declares
an issue that is not the failure's cause hides the failure.

A repro shows what the kernel does on the TPU generation it was recorded for. An issue of one generation's
code (``generations``: the kernel's chip branches and tuned tables, the compiler's per-chip arithmetic) is
replayed on a real chip only with a repro recorded for that chip or for none (``repro_on_chip``): a v6e
repro passing on a v5e says nothing about the issue.

The helpers below restate what a predicate needs from a case (a sequence's queries and keys, its logits,
the keys the causal mask and the window hide), once for every target's catalogue.
"""

import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from rpa_harness import failures, generations, runlog
from rpa_harness.strategies.case import Case

__all__ = [  # what an adapter imports (docs/targets.md)
    "KnownIssue",
    "KnownIssueError",
    "Kernel",
    "TuningFinding",
    "findings_dir",
    "case_arrays",
    "keep_sequences",
    "sequence_queries_and_keys",
    "soft_capped_logits",
    "hidden_keys",
    "NUMERIC_MISMATCH",
    "FLOAT32_EXP_UNDERFLOW",
]


def findings_dir(name: str) -> Path:
    """A findings folder: ``docs/NAME`` in a checkout, ``rpa_harness/findings/NAME`` where the wheel put it."""
    here = Path(__file__).resolve().parent
    installed = here / "findings" / name
    return installed if installed.is_dir() else here.parent / "docs" / name


OPTION = "--rpa-known-issues"
# The known-issue property's prediction of a chip: on an interpreter emulating a generation, each finding
# replayed as a chip of that generation replays it (tests/properties/test_known_issues.py).
PREDICT_CHIP_OPTION = "--rpa-predict-chip"
AUTO, NONE = "auto", "none"
# The smallest positive float32 is exp(-103.3); a weight exp(x) with x below this is exactly 0 in float32
# (the margin covers the difference between float64 logits here and the kernel's float32 ones).
FLOAT32_EXP_UNDERFLOW = -110.0
# The symptom of a numeric discrepancy in a property failure (rpa_harness.reference.Comparison).
NUMERIC_MISMATCH = r"elements over the bound"


class KnownIssueError(ValueError):
    """An unknown known-issue name or a malformed declaration; the message lists the known names."""


@dataclasses.dataclass(frozen=True)
class KnownIssue:
    name: str
    description: str  # one line: what goes wrong, for the run summary and the report title
    repro: Path  # the repro pair's JSON (its NPZ beside it)
    matches: Callable[[Case], bool]  # True when the case can trigger the issue
    nearest_outside: Callable[[Case], Case]  # a case close to the argument that does not match
    symptom: str  # a regex the property failure of the repro shows while the issue is present
    # How the repro is replayed: None for the generic property it records (rpa_harness.checks.recheck),
    # else replay(issue, target, backend, repro) raising AssertionError while the issue is present.
    replay: Callable | None = None
    # For the upstream report (``rpa-harness report``): where in the kernel it goes wrong and why, in a
    # maintainer's words (Markdown); empty where the report's facts speak for themselves.
    explanation: str = ""
    # The backends that can see it (e.g. a read past a VMEM buffer whose value is unused: only the checking
    # TPU interpreter reports it); empty for every backend. Elsewhere its cases are drawn, and its repro
    # must pass.
    backends: tuple[str, ...] = ()
    # The releases of the kernel's distribution that have it, as a PEP 440 specifier (``>=0.18.0,<0.23.0``),
    # each range checked by replaying the repro inside and outside it; empty for every release.
    releases: str = ""
    # The TPU generations whose code has it, as ``rpa_harness.generations`` names them (``v6e``, ``7x``):
    # where the kernel branches on the chip or takes a per-chip default, or where the compiler's arithmetic
    # differs per chip; empty for every generation. A real chip of another generation draws its cases and
    # does not replay it.
    generations: tuple[str, ...] = ()
    # The failure kinds its repro fails as (``rpa_harness.failures`` classes: ``OverTheBound``,
    # ``WouldHaltATpu``, ``RaisedOnValidInput``, ...; a located kind, past 2^15 keys, is its kind): a failure
    # of another kind is not offered this issue. Empty: it is offered for none.
    fails_as: tuple[type[failures.PropertyFailure], ...] = ()

    def __post_init__(self):
        SpecifierSet(self.releases)  # raises InvalidSpecifier for a malformed range, at import
        generations.check_declared(self.generations)
        if isinstance(self.fails_as, type):  # one kind, not in a tuple
            object.__setattr__(self, "fails_as", (self.fails_as,))
        not_kinds = [
            kind
            for kind in self.fails_as
            if not (isinstance(kind, type) and issubclass(kind, failures.PropertyFailure))
        ]
        if not_kinds:
            raise KnownIssueError(
                f"known issue {self.name!r}: fails_as={self.fails_as!r} holds {not_kinds!r}, which is not a "
                f"failure kind; declare classes of rpa_harness.failures, e.g. "
                f"fails_as=({failures.OverTheBound.__name__},) for outputs over the bound"
            )

    def __repr__(self) -> str:  # one line where Hypothesis and pytest print it (a parameter of a property)
        return f"KnownIssue({self.name!r})"

    def avoid(self, case: Case) -> Case:
        """The case itself, or the nearest case outside the issue (counted in the run log)."""
        if not self.matches(case):
            return case
        runlog.record_event("known-issue-avoided", issue=self.name)
        return self.nearest_outside(case)

    def visible_on(self, backend_name: str) -> bool:
        """Whether a run on ``backend_name`` can see the issue (``backends``)."""
        return not self.backends or backend_name in self.backends

    def applies_to(self, generation: str) -> bool:
        """Whether the kernel's code for TPU ``generation`` has the issue (``generations``); ``none``, the
        CPU device of an interpreter that emulates no chip, is judged by the predicate alone."""
        return not self.generations or generation in (generations.NONE, *self.generations)

    def repro_on_chip(self, chip: str) -> tuple[Path | None, str]:
        """The repro a real TPU of generation ``chip`` replays, or None and why it replays none (a phrase,
        then its detail in parentheses): the issue does not apply to the chip, or no repro in its folder
        was recorded for it (or for no generation)."""
        if not self.applies_to(chip):
            return None, f"does not apply to {chip} (it is in the code of {', '.join(self.generations)} only)"
        recorded = {path: recorded_generation(path) for path in self.repros()}
        for_this_chip = [path for path, generation in recorded.items() if generation == chip]
        if for_this_chip:
            return for_this_chip[0], ""
        if recorded[self.repro] == generations.NONE:
            return self.repro, ""
        return None, (
            f"recorded for {recorded[self.repro]}, not replayed on {chip} (a repro recorded for {chip} beside "
            f"it would be; `rpa-harness replay {self.repro} --backend fast-interpret --tpu-generation {chip}` "
            "shows whether the case shows the issue there)"
        )

    def repros(self) -> list[Path]:
        """The issue's repro, then the other repros in its folder (a repro per generation it applies to)."""
        others = sorted(
            path
            for path in self.repro.parent.glob("*.json")
            if path != self.repro and not path.name.endswith(".pending.json")
        )
        return [self.repro, *others]

    def affects(self, version: str) -> bool:
        """Whether release ``version`` has the issue (``releases``). A development or local build
        (``0.23.0.dev4``, ``0.22.1+tpu``) counts as its release; a version that is not PEP 440 (or none
        installed) counts as affected, so that no issue is dropped for want of a number."""
        try:
            release = Version(Version(version).base_version)
        except InvalidVersion:
            return True
        return SpecifierSet(self.releases).contains(release, prereleases=True)

    def kind_of(self, failure: BaseException) -> type[failures.PropertyFailure] | None:
        """The kind of ``fails_as`` that ``failure`` is, or None where the issue does not fail that way."""
        return next((kind for kind in self.fails_as if isinstance(failure, kind)), None)

    def shows(self, failure: str) -> bool:
        """Whether a property failure is this issue's (and not some other failure of the repro)."""
        return re.search(self.symptom, failure) is not None


@dataclasses.dataclass(frozen=True)
class TuningFinding:
    """A batch of ``rpa-harness bench`` (``rpa_harness.bench.BATCHES``) on which a target's own block
    sizes lose to ones its rules accept (``rpa_harness.tuning``), on the chips named.

    ``generations``: the TPU generations whose tuning has it (``rpa_harness.generations`` names; empty for
    every generation). ``measured``: what a chip measured, in words, for the finding's docs and report."""

    name: str
    batch: str
    generations: tuple[str, ...] = ()
    measured: str = ""

    def __post_init__(self):
        generations.check_declared(self.generations)

    def applies_to(self, generation: str) -> bool:
        return not self.generations or generation in self.generations


def recorded_generation(repro_json: Path) -> str:
    """The TPU generation a repro was recorded for: the one an interpreter emulated, or the chip's own
    (``rpa_harness.repro``'s ``tpu_generation``; ``none`` where it names none)."""
    return json.loads(repro_json.read_text()).get("tpu_generation", generations.NONE)


# --- What predicates read from a case ---------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def case_arrays(case: Case) -> dict:
    """``case.arrays()`` for predicates, read-only and built once while several predicates judge the same
    case (a long case's cache is hundreds of MiB, built in seconds)."""
    arrays = case.arrays()
    for array in arrays.values():
        array.flags.writeable = False
    return arrays


def keep_sequences(case: Case, keep: list[bool]) -> Case:
    """The case with only the sequences ``keep`` marks."""
    return dataclasses.replace(
        case,
        q_lens=tuple(q for q, k in zip(case.q_lens, keep, strict=True) if k),
        kv_lens=tuple(kv for kv, k in zip(case.kv_lens, keep, strict=True) if k),
    )


def sequence_queries_and_keys(case: Case, arrays: dict, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """One sequence's query rows [q_len, num_q_heads, head_dim] and its keys [kv_len, num_kv_heads, head_dim],
    as stored (the keys read from its pages)."""
    q_len, kv_len = case.q_lens[seq], case.kv_lens[seq]
    start = sum(case.q_lens[:seq])
    pages = arrays["page_indices"][seq, : math.ceil(kv_len / case.page_size)]
    k = arrays["kv_pages"][pages][:, :, 0::2, :].reshape(-1, case.num_kv_heads, case.head_dim)[:kv_len]
    return arrays["q"][start : start + q_len], k


def soft_capped_logits(case: Case, q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """[q_len, num_q_heads, kv_len] float64 logits q.k * scale, soft-capped; q head h reads KV head
    h // (num_q_heads / num_kv_heads). One matrix product per KV head's group (BLAS), the keys never
    repeated: a long context's keys are hundreds of MiB in float64, and drawing a case judges them."""
    (q_len, _, head_dim), kv_len = q.shape, k.shape[0]
    group = case.num_q_heads // case.num_kv_heads
    grouped = q.astype(np.float64).reshape(q_len, case.num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
    keys = k.astype(np.float64).transpose(1, 2, 0)[:, None]  # [kv_heads, 1, head_dim, kv_len]
    logits = np.matmul(grouped, keys).reshape(case.num_q_heads, q_len, kv_len).transpose(1, 0, 2)
    logits *= scale
    if case.soft_cap is not None:
        logits /= case.soft_cap
        np.tanh(logits, out=logits)
        logits *= case.soft_cap
    return logits


def hidden_keys(
    case: Case, q_len: int, kv_len: int, rows: slice = slice(None), keys: slice = slice(None)
) -> np.ndarray:
    """[q_len, kv_len] True where the causal mask or the sliding window hides the key from the row; only
    ``rows`` and ``keys`` of it where given."""
    position = kv_len - q_len + np.arange(q_len)[rows, None]
    key = np.arange(kv_len)[None, keys]
    masked = key > position
    if case.sliding_window is not None:
        masked |= position - case.sliding_window >= key
    return masked


# --- Declarations ------------------------------------------------------------------------------------------


def resolve(entries, where: str, catalogue: tuple[KnownIssue, ...]) -> tuple[KnownIssue, ...]:
    """Entries for names in ``catalogue`` (a declaration may also hold ``KnownIssue`` objects)."""
    if isinstance(entries, str):
        entries = (entries,)
    by_name = {issue.name: issue for issue in catalogue}
    issues = []
    for entry in entries:
        if isinstance(entry, KnownIssue):
            issues.append(entry)
        elif entry in by_name:
            issues.append(by_name[entry])
        else:
            raise KnownIssueError(
                f"{where}: unknown known issue {entry!r}; known issues: {', '.join(by_name)} "
                f"(or '{AUTO}' for the target's own declaration, '{NONE}' for none)"
            )
    return tuple(issues)


def parse_option(value: str, declared: tuple[KnownIssue, ...], catalogue) -> tuple[KnownIssue, ...]:
    """``auto`` (the target's declaration), ``none``, or a comma-separated list of names in ``catalogue``."""
    value = value.strip()
    if value == AUTO:
        return declared
    if value == NONE:
        return ()
    names = [name.strip() for name in value.split(",") if name.strip()]
    return resolve(names, f"{OPTION}={value}", tuple(catalogue) + tuple(declared))


def on_generation(issues: tuple[KnownIssue, ...], generation: str) -> tuple[KnownIssue, ...]:
    """``issues`` whose predicates see TPU ``generation`` (``rpa_harness.generations.emulated``), as the
    kernel does while traced for it: a predicate that restates the kernel's blocking reads the block sizes
    the kernel chooses for that chip. Unchanged for ``none``."""
    if generation == generations.NONE:
        return tuple(issues)

    def seeing(function):
        @functools.wraps(function)
        def on_the_chip(case):
            with generations.emulated(generation):
                return function(case)

        return on_the_chip

    return tuple(
        dataclasses.replace(
            issue, matches=seeing(issue.matches), nearest_outside=seeing(issue.nearest_outside)
        )
        for issue in issues
    )


@dataclasses.dataclass(frozen=True)
class Kernel:
    """The kernel a catalogued issue is of: the target whose catalogue holds it, and whether that kernel
    takes latent attention cases (MLA: ``Case.value_head_dim`` set, ``Capabilities.value_head_dims``) or
    ordinary ones. A case of the other API never reaches that kernel, so its issues are not offered for it."""

    target: str
    latent: bool

    def takes(self, case: Case) -> bool:
        return (case.value_head_dim is not None) == self.latent


def _may_match(issue: KnownIssue, case: Case) -> bool:
    """``issue.matches(case)`` for a suggestion: a predicate written for another kernel's space may not
    handle every case (it raises); it then suggests nothing."""
    try:
        return issue.matches(case)
    except Exception:
        return False


def describe_matches(
    case: Case, failure: BaseException, catalogue: tuple[KnownIssue, ...], kernels: dict[str, Kernel]
) -> str:
    """The lines of a failure report naming the catalogued issues that fit the failure: of a kernel in
    ``kernels`` (by issue name) that takes the case's API, failing as the failure's kind, and whose
    predicate matches the case (judged last: a predicate may build the case's arrays). One line per issue,
    with its kernel and its symptom; one line saying so where none fits."""
    fitting = [
        (issue, kernels[issue.name], kind)
        for issue in catalogue
        if issue.name in kernels and kernels[issue.name].takes(case)
        for kind in [issue.kind_of(failure)]
        if kind is not None and _may_match(issue, case)
    ]
    if not fitting:
        failing_as = getattr(failure, "kind", type(failure).__name__)
        api = "latent attention (MLA)" if case.value_head_dim is not None else "ordinary attention"
        return (
            f"\n  known issues this case matches: none (no catalogued finding of a kernel taking {api} cases "
            f"fails as {failing_as} with a predicate matching this case)"
        )
    lines = "".join(
        f"\n    {issue.name} (kernel {kernel.target}; symptom: {kind.kind})"
        for issue, kernel, kind in fitting
    )
    return (
        "\n  known issues this case matches, each failing as this failure does "
        f"(declare one in RPA_HARNESS_KNOWN_ISSUES or with {OPTION} once its cause is this failure's):{lines}"
    )
