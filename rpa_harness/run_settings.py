"""A run's settings, resolved in one place from whatever states them: pytest's options, or a repro.

What a run judges is decided here and nowhere else: the target (its profile, with the precision contract
and known issues the run names applied, and the buckets it draws), the backends (with the interpreter
compatibility layer on or off and the TPU generations emulated) and the Hypothesis profile. The pytest
plugin resolves them once per session (``from_options``, kept in ``config.stash``); ``rpa-harness replay``,
``rpa-harness report`` and the known-issue property resolve a repro's (``for_repro``), so a repro is judged
the same way wherever it is replayed: under the contract it failed under, on its backend, with its
compatibility setting and its generation, unless the caller overrides one of them.
"""

import dataclasses

from rpa_harness import ahead_of_time, device, generations, known_issues, targets
from rpa_harness.device import Backend
from rpa_harness.reference.tolerance import PrecisionError, parse_precision
from rpa_harness.strategies.buckets import BucketError
from rpa_harness.strategies.shapes import select_buckets
from rpa_harness.targets import Target

# pytest's options as ``rpa-harness`` names them: its errors speak the user's terms (``in_cli_terms``).
CLI_OPTION_NAMES = {
    "--rpa-target": "--target",
    "--rpa-backend": "--backend",
    "--rpa-buckets": "--buckets",
    generations.OPTION: "--tpu-generation",
    "--rpa-repro-dir": "--repro-dir",
}
# Set by ``rpa-harness run`` for its pytest: the plugin's usage errors then name the command's options.
CLI_TERMS_ENV = "RPA_CLI_OPTION_NAMES"


def in_cli_terms(message: str) -> str:
    """A message naming pytest's options (``--rpa-target=x``) with ``rpa-harness``'s (``--target x``)."""
    for option, name in CLI_OPTION_NAMES.items():
        message = message.replace(f"{option}=", f"{name} ").replace(option, name)
    return message


class SettingError(ValueError):
    """A setting that cannot be used; the message names it and says what to pass instead. ``given``: the
    caller stated it (a usage error), else it came from a file (a bad repro)."""

    def __init__(self, message: str, *, given: bool = True):
        super().__init__(message)
        self.given = given


@dataclasses.dataclass(frozen=True)
class RunSettings:
    target: Target  # with the run's precision contract and known issues applied
    backends: tuple[Backend, ...]  # in order; the first is where one-call-per-example properties run
    profile: str  # the Hypothesis profile chosen (before RPA_MAX_EXAMPLES resizes it)
    # The buckets drawn: the strategies' ``selection`` (None: the defaults within the declaration).
    buckets: tuple[str, ...] | None = None
    # The backends are --rpa-backend=auto's, not chosen by name: the target's slow ones are skipped.
    backends_by_default: bool = False
    # The TPU generations the compile property compiles for on this host (``compile_generations``).
    compile_generations: tuple[str, ...] = ()

    @property
    def interpreter_compat(self) -> bool:
        return bool(self.backends) and self.backends[0].interpreter_compat

    @property
    def emulated_generations(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(b.generation for b in self.backends if b.generation != generations.NONE))


def from_options(
    *,
    target: str,
    backend: str = device.AUTO,
    interpreter_compat: bool = True,
    precision: str = "",
    known_issue_names: str = known_issues.AUTO,
    buckets: str = "",
    tpu_generation: str = generations.AUTO,
    profile: str,
) -> RunSettings:
    """The settings of a property run, from option values as given (strings, as on a command line)."""
    try:
        loaded = targets.load(target)
    except targets.TargetError as error:
        raise SettingError(str(error)) from None
    if precision:
        try:
            loaded = dataclasses.replace(loaded, precision=parse_precision(precision))
        except PrecisionError as error:
            raise SettingError(f"--rpa-precision: {error}") from None
    try:
        declared = known_issues.parse_option(
            known_issue_names, loaded.known_issues, loaded.catalogue + targets.shipped_catalogue()
        )
    except known_issues.KnownIssueError as error:
        raise SettingError(str(error)) from None
    try:
        selection = select_buckets(loaded.capabilities, buckets, profile=profile)
    except BucketError as error:
        raise SettingError(f"--rpa-buckets: {error} (target {loaded.name})") from None
    loaded = dataclasses.replace(loaded, known_issues=declared)
    try:
        chosen = device.resolve(backend)
        emulated = generations.select(tpu_generation, loaded.capabilities.tpu_generations, profile=profile)
    except (device.BackendChoiceError, generations.GenerationError) as error:
        raise SettingError(str(error)) from None
    return RunSettings(
        loaded,
        tuple(
            Backend(name, interpreter_compat, generation)
            for name in chosen
            for generation in (emulated if name != device.TPU else (generations.NONE,))
        ),
        profile,
        selection,
        backends_by_default=backend == device.AUTO,
        compile_generations=compile_generations(chosen, tpu_generation, emulated, profile),
    )


def compile_generations(chosen, tpu_generation: str, emulated, profile: str) -> tuple[str, ...]:
    """What the compile property compiles for: the generations the interpreters emulate; where they emulate
    none, v5e and v6e (the nightly profile: every generation with a known topology), unless the run named
    ``none``. None on a real TPU, which compiles every case for itself."""
    if chosen == (device.TPU,):
        return ()
    named = tuple(name for name in emulated if name != generations.NONE)
    if named or (tpu_generation or generations.AUTO).strip() != generations.AUTO:
        return named
    everyday = (
        generations.EVERYDAY_GENERATIONS if profile != "nightly" else tuple(ahead_of_time.TOPOLOGY_NAMES)
    )
    return tuple(name for name in everyday if name in generations.DEVICE_KINDS)


def for_repro(
    repro,
    *,
    target: str | None = None,
    backend: str | None = None,
    tpu_generation: str | None = None,
    interpreter_compat: bool | None = None,
) -> RunSettings:
    """The settings a repro was recorded under, each overridable: its target, its backend with its
    compatibility setting and generation, and the precision contract it failed under (a repro written
    before contracts were recorded is judged under the target's own)."""
    generation = tpu_generation or repro.tpu_generation
    if (backend or repro.backend) == device.TPU and tpu_generation is None:
        generation = generations.NONE  # a chip is the chip it is; the recorded one says where it ran
    compat = repro.interpreter_compat if interpreter_compat is None else interpreter_compat
    try:
        chosen = Backend(backend or repro.backend, compat, generation)
    except generations.GenerationError as error:
        raise SettingError(str(error), given=tpu_generation is not None) from None
    try:
        loaded = targets.load(target or repro.target)
    except targets.TargetError as error:
        raise SettingError(str(error), given=target is not None) from None
    if repro.precision is not None:
        try:
            loaded = dataclasses.replace(loaded, precision=parse_precision(repro.precision))
        except PrecisionError as error:
            raise SettingError(f"its precision: {error}", given=False) from None
    return RunSettings(loaded, (chosen,), profile="repro")
