"""Targets: a kernel module under test, and its profile (what the harness draws for it and holds it to).

A target is any importable module with upstream's ``ragged_paged_attention`` and, if its kernel validates
metadata on the host, ``dynamic_validate_inputs`` (an adapter module wraps a kernel with another API; ``rpa_harness.targets.layouts`` converts the layouts).
Its profile is read from these module attributes (``PROFILE_ATTRIBUTES``), each optional; any other
``RPA_HARNESS_*`` name in the module is taken for a misspelt one and fails the load, naming the nearest:

- ``RPA_HARNESS_CAPABILITIES``: a dict of ``rpa_harness.strategies.valid.Capabilities`` fields (or a
  ``Capabilities``): what the strategies draw for it (default: the whole specified space).
- ``RPA_HARNESS_PRECISION``: the precision contract its outputs are judged under (names from
  ``reference.CONTRACTS``; default float32 throughout; ``--rpa-precision`` overrides it).
- ``RPA_HARNESS_PRODUCT_PRECISION``: the precision its matrix products of float32 operands pass, read from
  its source: ``"highest"`` (the default: its precision contract holds on a TPU as declared) or
  ``"default"`` (DEFAULT or none, one bfloat16 pass on a TPU's MXU: on a TPU generation, real or emulated,
  it is judged with ``bf16-matmul`` added, ``Target.precision_on``).
- ``RPA_HARNESS_RULES``: its validators' rule table (``rpa_harness.strategies.violations.Rule`` by name;
  default the specification's ``RULES``, upstream's rules and messages).
- ``RPA_HARNESS_KNOWN_ISSUES``: the known issues whose cases are not drawn (catalogue names or
  ``rpa_harness.known_issues.KnownIssue`` objects; ``--rpa-known-issues`` overrides it).
- ``RPA_HARNESS_CATALOGUE``: every known issue of its kind, declared or not (named in failure reports
  that fit it: ``rpa_harness.known_issues.describe_matches``).
- ``RPA_HARNESS_VERSION``: the version the run header shows (default: the installed distribution's).
- ``RPA_HARNESS_GENERATION_HOOK``: for a kernel that learns its TPU generation some way emulation does not
  cover, a function of the generation name returning a context manager (``rpa_harness.generations``).
- ``RPA_HARNESS_PROPERTIES``: properties of its own, by kind (``rpa_harness.property_names``): a dict of
  kind -> ``check(target, backend, arrays, options)`` raising ``rpa_harness.checks.PropertyFailure`` while the repro
  still fails; ``rpa-harness replay`` and the known-issue property run it for a repro of that kind (v3's
  targets judge both outputs, the attention and the returned cache).
- ``RPA_HARNESS_UPDATES_CACHE``: True for a kernel that writes the new tokens into the cache: its
  ``ragged_paged_attention`` returns ``(attention, updated kv_pages)`` in upstream's layout, and every
  numeric property judges that cache bit for bit (``rpa_harness.cache_judge.check_updated_cache``).
- ``RPA_HARNESS_KERNEL``: for an adapter that imports its kernel on first use (so that its catalogue
  imports without the kernel), the function that imports it, raising ImportError with how to install it:
  loading the target calls it, so a missing kernel is one usage error, not a failure of every call.
- ``RPA_HARNESS_COMPILED_CALL``: for an adapter that maps a call on the host (reading its inputs'
  values with NumPy), a function ``(arrays, options) -> (kernel function, positional arguments)``: what the
  chip compiles for those arrays, mapped here, the arguments NumPy arrays or None. The compile property
  compiles that function on their shapes (without it, it compiles ``ragged_paged_attention`` on the
  case's shapes, which such an adapter cannot be traced on). ``rpa-harness bench`` times that function too
  (the mapping done once, outside the timing).
- ``RPA_HARNESS_BASELINE``: the module name of the target ``rpa-harness bench`` compares this one with
  (default upstream's kernel): a fork of v3 names v3.
- ``RPA_HARNESS_REPORT``: for a kernel whose API is not upstream's, its own ``rpa-harness report``: a
  function ``(path, repro, backend, known_issue, shown_path, *, precision, with_script_output)`` (the
  repro's settings as ``rpa_harness.run_settings.for_repro`` resolves them) returning the Markdown
  report, raising ``rpa_harness.report_sections.NothingToReport`` when the repro does not reproduce (default: the
  report for upstream's API, ``rpa_harness.bug_report``).

A module that cannot declare them (jax's upstream kernel; the bundled kernel, which stays free of the
harness) gets them from its profile module in this package. The shipped targets are one table, ``SHIPPED``:
``bundled`` and ``upstream`` are profiles of kernel modules elsewhere; ``tpu_inference_v3`` and
``tpu_inference_v3_hd64`` are packages (profile, adapter, both outputs judged, rules, known issues, report).
"""

import dataclasses
import difflib
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import sys
import traceback
import types
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from rpa_harness import generations, known_issues, property_names
from rpa_harness.device import TPU
from rpa_harness.reference.tolerance import (
    BF16_MATMUL,
    DEFAULT_PRECISION,
    TPU_TRANSCENDENTALS,
    PrecisionError,
    parse_precision,
)
from rpa_harness.strategies.capabilities import Capabilities
from rpa_harness.strategies.violations import RULES, check_table

DEFAULT_TARGET = "rpa_harness.kernel"  # the bundled kernel
LEGACY_DEFAULT_TARGET = "kernel"  # its folder's name, which a checkout can still pass
UPSTREAM_TARGET = "jax.experimental.pallas.ops.tpu.ragged_paged_attention"
V3_TARGET = "rpa_harness.targets.tpu_inference_v3"
V3_HD64_TARGET = "rpa_harness.targets.tpu_inference_v3_hd64"
V2_TARGET = "rpa_harness.targets.tpu_inference_v2"
MLA_V1_TARGET = "rpa_harness.targets.tpu_inference_mla_v1"
MLA_V2_TARGET = "rpa_harness.targets.tpu_inference_mla_v2"
V3_CP_TARGET = "rpa_harness.targets.tpu_inference_rpa_v3_cp"
BATCHED_RPA_TARGET = "rpa_harness.targets.tpu_inference_batched_rpa"
STACKED_RPA_TARGET = "rpa_harness.targets.tpu_inference_stacked_rpa"
MLA_SWA_TARGET = "rpa_harness.targets.tpu_inference_mla_swa"
REQUIRED_FUNCTIONS = ("ragged_paged_attention",)
# RPA_HARNESS_PRODUCT_PRECISION: lax.Precision's names for what a kernel passes to its float32 products.
HIGHEST_PRODUCTS = "highest"
DEFAULT_PRODUCTS = "default"
VALIDATOR = "dynamic_validate_inputs"  # optional: a kernel without one declares only static rules


# The specification of a profile: every attribute a target module may declare (the module docstring says
# what each means). A module with any of these declares its own profile; any other RPA_HARNESS_* name in it is
# a typo, which fails the load (``_check_profile_names``) rather than leaving that declaration at its default.
PROFILE_PREFIX = "RPA_HARNESS_"
PROFILE_ATTRIBUTES = (
    "RPA_HARNESS_CAPABILITIES",
    "RPA_HARNESS_PRECISION",
    "RPA_HARNESS_PRODUCT_PRECISION",
    "RPA_HARNESS_RULES",
    "RPA_HARNESS_KNOWN_ISSUES",
    "RPA_HARNESS_CATALOGUE",
    "RPA_HARNESS_VERSION",
    "RPA_HARNESS_GENERATION_HOOK",
    "RPA_HARNESS_REPORT",
    "RPA_HARNESS_PROPERTIES",
    "RPA_HARNESS_UPDATES_CACHE",
    "RPA_HARNESS_KERNEL",
    "RPA_HARNESS_BASELINE",
    "RPA_HARNESS_COMPILED_CALL",
    "RPA_HARNESS_TUNING_FINDINGS",
)


@dataclasses.dataclass(frozen=True)
class Shipped:
    """A target the harness ships: adding one is one entry of ``SHIPPED`` (and its package in pyproject.toml)."""

    name: str  # the module a run names
    profile: str | None = None  # the module holding its RPA_HARNESS_* (None: the target module itself)
    also_modules: tuple[str, ...] = ()  # other kernel modules the same profile describes
    aliases: tuple[str, ...] = ()  # shorter names for it, on the command line and in repros


SHIPPED = (
    Shipped(DEFAULT_TARGET, profile="rpa_harness.targets.bundled"),
    Shipped(
        UPSTREAM_TARGET, profile="rpa_harness.targets.upstream", also_modules=(f"{UPSTREAM_TARGET}.kernel",)
    ),
    Shipped(V3_TARGET, aliases=("rpa_harness.tpu_inference_v3",)),
    Shipped(V3_HD64_TARGET, aliases=("rpa_harness.tpu_inference_v3_hd64",)),
    Shipped(V2_TARGET, aliases=("rpa_harness.tpu_inference_v2",)),
    Shipped(MLA_V1_TARGET, aliases=("rpa_harness.tpu_inference_mla_v1",)),
    Shipped(MLA_V2_TARGET, aliases=("rpa_harness.tpu_inference_mla_v2",)),
    Shipped(V3_CP_TARGET, aliases=("rpa_harness.tpu_inference_rpa_v3_cp",)),
    Shipped(BATCHED_RPA_TARGET, aliases=("rpa_harness.tpu_inference_batched_rpa",)),
    Shipped(STACKED_RPA_TARGET, aliases=("rpa_harness.tpu_inference_stacked_rpa",)),
    Shipped(MLA_SWA_TARGET, aliases=("rpa_harness.tpu_inference_mla_swa",)),
)
# Profile modules of targets that do not declare their own (module attributes as above).
PROFILES = {name: s.profile for s in SHIPPED if s.profile for name in (s.name, *s.also_modules)}
ALIASES = {alias: s.name for s in SHIPPED for alias in s.aliases}
# The shipped targets' catalogues (RPA_HARNESS_CATALOGUE): any target may name their issues, whatever
# kernels are installed (v3's modules import their kernel on first use). Each is the catalogue of the
# shipped target of the same position in SHIPPED.
SHIPPED_CATALOGUES = tuple(s.profile or s.name for s in SHIPPED)


class TargetError(Exception):
    """A target module that cannot be used; the message says why and what to pass instead."""


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    module: types.ModuleType
    capabilities: Capabilities
    precision: tuple[str, ...] = DEFAULT_PRECISION  # the precision contract its outputs are judged under
    known_issues: tuple = ()  # rpa_harness.known_issues.KnownIssue entries: their cases are not drawn
    rules: dict = dataclasses.field(default_factory=lambda: RULES)  # its validators' rule table
    catalogue: tuple = ()  # every KnownIssue of its kind (named when a failing case matches one)
    version: str | None = None
    generation_hook: Callable | None = None  # its own way of being told the emulated TPU generation
    report: Callable | None = None  # its own upstream-ready report (None: upstream's API's)
    properties: dict = dataclasses.field(
        default_factory=dict
    )  # kind -> check(target, backend, arrays, options)
    updates_cache: bool = False  # its call returns (attention, updated kv_pages), the cache judged too
    product_precision: str = (
        HIGHEST_PRODUCTS  # what its float32 products pass (RPA_HARNESS_PRODUCT_PRECISION)
    )
    compiled_call: Callable | None = None  # (arrays, options) -> (kernel function, arguments) to compile
    baseline: str | None = None  # the target `rpa-harness bench` compares it with (RPA_HARNESS_BASELINE)
    # Whose each catalogue entry is, by issue name (known_issues.Kernel): a failure is offered an entry only
    # for a case of that kernel's API, and the suggestion names the kernel.
    catalogue_kernels: dict = dataclasses.field(default_factory=dict)
    # The batches on which its own block sizes are known to lose (known_issues.TuningFinding entries;
    # RPA_HARNESS_TUNING_FINDINGS): `rpa-harness bench --sweep-blocks` gives each its verdict on a chip.
    tuning_findings: tuple = ()

    def precision_on(self, backend) -> tuple[str, ...]:
        """The contract its outputs are judged under on ``backend``: the declared one, plus ``bf16-matmul``
        where a TPU generation (a chip, or one an interpreter emulates) multiplies its float32 operands at
        DEFAULT precision in one bfloat16 pass, plus ``tpu-transcendentals`` on a chip, whose exp, tanh and
        division are not correctly rounded (the interpreters' are). That is what the chip computes, not a
        looser tolerance."""
        precision = self.precision
        if self.product_precision == DEFAULT_PRODUCTS and backend.has_tpu_generation:
            precision = (*precision, BF16_MATMUL)
        if backend.name == TPU:
            precision = (*precision, TPU_TRANSCENDENTALS)
        return parse_precision(precision)

    def __reduce__(self):
        """A target travels by its name (a kernel call to the chip's owner process carries its method): the
        module is loaded there, once."""
        return (loaded, (self.name,))

    def __repr__(self) -> str:  # one line where Hypothesis prints a failing example's arguments
        return f"Target({self.name!r})"

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # Hypothesis's printer would list every field
        printer.text(repr(self))

    def attention(self, arrays: dict, options: dict):
        """Calls the target's kernel on NumPy inputs (converted to jax arrays, as users call it)."""
        with generations.hooked(self.generation_hook):
            return self.module.ragged_paged_attention(**as_jax(arrays), **options)

    def signature(self, arrays: dict, options: dict) -> tuple:
        """What decides whether a call of ``attention`` compiles: the target, its arrays' shapes and dtypes,
        and its options, those it takes at run time (``capabilities.runtime_options``) by whether they are
        given, the others by value. Two calls with one signature share one compilation."""
        runtime = self.capabilities.runtime_options
        shapes = tuple(
            (name, tuple(np.shape(value)), str(getattr(value, "dtype", type(value).__name__)))
            for name, value in sorted(arrays.items())
        )
        given = tuple((name, options.get(name) is not None) for name in runtime)  # absent: None
        static = tuple(
            (name, type(value).__name__, repr(value))
            for name, value in sorted(options.items())
            if name not in runtime
        )
        return (self.name, shapes, given, static)

    def precompile(self, arrays: dict, options: dict) -> bool:
        """Traces, lowers and compiles what ``attention(arrays, options)`` runs, without running it, so that
        the call finds it compiled (jax keeps a jitted function's compilation for its arguments' shapes).
        False where the target's call is not one jitted function that compiles alone: it then compiles in
        its call. Raises what tracing or compiling raises (the call would raise it too)."""
        with generations.hooked(self.generation_hook):
            if self.compiled_call is not None:
                function, arguments = self.compiled_call(arrays, options)
                if not hasattr(function, "lower"):
                    return False
                function.lower(*arguments).compile()
                return True
            function = self.module.ragged_paged_attention
            if not hasattr(function, "lower"):
                return False
            function.lower(**arrays, **options).compile()
            return True

    def capabilities_on(self, backend) -> Capabilities:
        """What is drawn for the target on ``backend``: where kernels see a TPU generation (a real chip or
        an emulated one), block sizes that default to a per-chip table may be left to it, unless the target
        keeps its own off the interpreters (``kernel_block_sizes_on_interpreters``)."""
        if backend.name != TPU and not self.capabilities.kernel_block_sizes_on_interpreters:
            return dataclasses.replace(self.capabilities, needs_block_sizes=True)
        if backend.has_tpu_generation and self.capabilities.needs_block_sizes:
            return dataclasses.replace(self.capabilities, needs_block_sizes=False)
        return self.capabilities

    def known_issues_on(self, backend) -> tuple:
        """The known issues whose cases are not drawn on ``backend`` (those it can see; on a real chip, those
        in its generation's code), their predicates seeing its emulated TPU generation
        (``known_issues.on_generation``)."""
        chip = backend.generation_seen if backend.name == TPU else generations.NONE
        visible = tuple(
            issue for issue in self.known_issues if issue.visible_on(backend.name) and issue.applies_to(chip)
        )
        return known_issues.on_generation(visible, backend.generation)

    def validate(self, arrays: dict, options: dict) -> None:
        getattr(self.module, VALIDATOR)(**as_jax(arrays), **options)

    @property
    def has_validator(self) -> bool:
        """Whether the module has ``dynamic_validate_inputs`` (a kernel without one has static rules only)."""
        return callable(getattr(self.module, VALIDATOR, None))

    @property
    def own_rules(self) -> bool:
        """Whether the target declares its own rule table (not the specification's)."""
        return self.rules is not RULES


def as_jax(arrays: dict) -> dict:
    """The arrays as jax arrays: ``jax.device_put`` gives what ``jnp.asarray`` does (dtype, weak type,
    uncommitted placement) without compiling an identity per shape and dtype, as ``jnp.asarray`` does on
    jax 0.10."""
    return {name: jax.device_put(value) for name, value in arrays.items()}


def shipped_findings() -> tuple[tuple[known_issues.KnownIssue, known_issues.Kernel], ...]:
    """Every known issue the shipped targets catalogue, in their order, each with its kernel (the shipped
    target and whether it takes latent attention cases); a target whose catalogue does not import
    contributes none."""
    found: list[tuple[known_issues.KnownIssue, known_issues.Kernel]] = []
    for shipped, name in zip(SHIPPED, SHIPPED_CATALOGUES, strict=True):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        catalogue = getattr(module, "RPA_HARNESS_CATALOGUE", ())
        if catalogue:
            kernel = known_issues.Kernel(shipped.name, _takes_latent_cases(shipped.name, module))
            found.extend((issue, kernel) for issue in catalogue)
    return tuple(found)


def shipped_catalogue() -> tuple:
    """Every known issue the shipped targets catalogue, in their order (``shipped_findings``)."""
    return tuple(issue for issue, _ in shipped_findings())


def _takes_latent_cases(name: str, profile: types.ModuleType) -> bool:
    """Whether the target ``profile`` declares takes latent attention (MLA) cases, not ordinary ones."""
    return bool(_capabilities(name, profile).value_head_dims)


def _bundled_kernel_under_its_folder_name(name: str) -> bool:
    """True for ``kernel`` when it would import this harness's own kernel folder (a checkout's ``kernel/``).

    The bundled kernel is ``rpa_harness.kernel``; importing its folder a second time as ``kernel`` would give a
    copy the harness does not know. A module of the user's own called ``kernel`` is theirs to test.
    """
    if name != LEGACY_DEFAULT_TARGET:
        return False
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    bundled = importlib.util.find_spec(DEFAULT_TARGET)
    return found is not None and bundled is not None and found.origin == bundled.origin


def _version(name: str, module: types.ModuleType, profile: types.ModuleType) -> str | None:
    """What the run header shows: the declared version, else the installed distribution that holds the
    module's top-level package, and its version."""
    declared = getattr(profile, "RPA_HARNESS_VERSION", None)
    if declared is not None:
        return str(declared)
    top = name.split(".")[0]
    distribution = _distribution_holding(sys.modules.get(top))
    if distribution is not None:
        return f"{distribution.metadata['Name']} {distribution.version}"
    version = getattr(sys.modules.get(top), "__version__", None)
    return f"{top} {version}" if version else None


def _distribution_holding(package: types.ModuleType | None) -> importlib.metadata.Distribution | None:
    """The installed distribution whose files hold ``package`` (a top-level module), or None.

    A top-level name alone does not decide it: distributions ship generic ones (tpu-inference installs a
    ``tests`` package), and a checkout's own folder of that name is not theirs.
    """
    where = getattr(package, "__file__", None)
    if package is None or where is None:
        return None
    origin = Path(where).resolve()
    if origin.name == "__init__.py":
        origin = origin.parent
    names = dict.fromkeys(importlib.metadata.packages_distributions().get(package.__name__, []))
    # Every installed copy of each (a checkout's egg-info is found before the environment's dist-info).
    for distribution in (found for name in names for found in importlib.metadata.distributions(name=name)):
        installed = Path(str(distribution.locate_file(package.__name__))).resolve()
        if origin in (installed, installed.with_suffix(".py")):
            return distribution
        source = json.loads(distribution.read_text("direct_url.json") or "{}")  # an editable install
        if source.get("dir_info", {}).get("editable"):
            folder = Path(urllib.parse.urlparse(source["url"]).path).resolve()
            if folder in origin.parents:
                return distribution
    return None


@functools.cache
def loaded(name: str) -> Target:
    """``load(name)``, once a process."""
    return load(name)


def load(name: str) -> Target:
    """Imports a target by module name and reads its profile; raises TargetError with a usable message."""
    name = ALIASES.get(name, name)
    if _bundled_kernel_under_its_folder_name(name):
        name = DEFAULT_TARGET
    try:
        module = importlib.import_module(name)
    except ImportError as error:
        bundled = (
            f" The bundled kernel is --rpa-target={DEFAULT_TARGET}." if name == LEGACY_DEFAULT_TARGET else ""
        )
        raise TargetError(
            f"--rpa-target={name}: cannot import it ({error}). Pass an importable module that defines "
            f"{REQUIRED_FUNCTIONS[0]}, e.g. --rpa-target={DEFAULT_TARGET}.{bundled}"
        ) from None
    missing = [fn for fn in REQUIRED_FUNCTIONS if not callable(getattr(module, fn, None))]
    if missing:
        raise TargetError(
            f"--rpa-target={name}: module {module.__name__} ({getattr(module, '__file__', '?')}) lacks "
            f"{', '.join(missing)}; a target must define {REQUIRED_FUNCTIONS[0]} (and, if its kernel has one, "
            f"{VALIDATOR}) with upstream's signatures."
        )
    _check_profile_names(name, module)
    declares = any(hasattr(module, attribute) for attribute in PROFILE_ATTRIBUTES)
    profile = module if declares or name not in PROFILES else importlib.import_module(PROFILES[name])
    if profile is not module:
        _check_profile_names(name, profile)
    import_kernel = getattr(profile, "RPA_HARNESS_KERNEL", None)
    if import_kernel is not None:
        try:
            import_kernel()
        except ImportError as error:
            raise TargetError(f"--rpa-target={name}: cannot import its kernel ({error})") from None
    return _target(name, module, profile)


def _check_profile_names(name: str, module: types.ModuleType) -> None:
    """Raises TargetError for an ``RPA_HARNESS_*`` name ``module`` defines that is no profile attribute: read
    with ``getattr``, a misspelt declaration would silently leave the target at that attribute's default."""
    for attribute, value in vars(module).items():
        if not attribute.startswith(PROFILE_PREFIX) or attribute in PROFILE_ATTRIBUTES:
            continue
        suffixes = [known.removeprefix(PROFILE_PREFIX) for known in PROFILE_ATTRIBUTES]
        # Compared without the shared prefix, which would make every name look alike.
        nearest = difflib.get_close_matches(attribute.removeprefix(PROFILE_PREFIX), suffixes, n=1, cutoff=0)
        shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:57]}..."
        raise TargetError(
            f"--rpa-target={name}: {module.__name__} defines {attribute} = {shown}, which is not a profile "
            f"attribute; did you mean {PROFILE_PREFIX}{nearest[0]}? Rename it (docs/targets.md lists the "
            f"profile's attributes) or drop the {PROFILE_PREFIX} prefix from a name of the module's own (a load "
            "error since rpa-harness 0.7.0: CHANGELOG.md, Stricter)"
        )


def _target(name: str, module: types.ModuleType, profile: types.ModuleType) -> Target:
    """The target ``profile`` declares for ``module``, each declaration checked in turn (TargetError says
    which is wrong and what to declare)."""
    capabilities = _capabilities(name, profile)
    precision, product_precision = _precision(name, profile), _product_precision(name, profile)
    rules = _rules(name, module, profile)
    updates_cache = _updates_cache(name, profile)
    issues, catalogue, catalogue_kernels = _known_issues(name, profile, capabilities)
    hook = _optional_function(name, profile, "RPA_HARNESS_GENERATION_HOOK", _DECLARE_HOOK)
    compiled_call = _optional_function(name, profile, "RPA_HARNESS_COMPILED_CALL", _DECLARE_COMPILED_CALL)
    report = _optional_function(name, profile, "RPA_HARNESS_REPORT", _DECLARE_REPORT)
    properties = _properties(name, profile)
    baseline = _baseline(name, profile)
    version = _version(name, module, profile)
    tuning_findings = _tuning_findings(name, profile)
    return Target(
        name, module, capabilities, precision, issues, rules, catalogue, version, hook, report, properties,
        updates_cache, product_precision, compiled_call,
        None if baseline is None else ALIASES.get(baseline, baseline), catalogue_kernels, tuning_findings,
    )  # fmt: skip


def _capabilities(name: str, profile: types.ModuleType) -> Capabilities:
    declared = getattr(profile, "RPA_HARNESS_CAPABILITIES", None)
    try:
        if declared is None:
            capabilities = Capabilities()
        elif isinstance(declared, Capabilities):
            capabilities = declared
        else:
            capabilities = Capabilities(**declared)
        generations.check_declared(capabilities.tpu_generations)
    except (TypeError, ValueError) as error:
        raise TargetError(f"--rpa-target={name}: RPA_HARNESS_CAPABILITIES: {error}") from None
    return capabilities


def _precision(name: str, profile: types.ModuleType) -> tuple[str, ...]:
    try:
        return parse_precision(getattr(profile, "RPA_HARNESS_PRECISION", DEFAULT_PRECISION))
    except PrecisionError as error:
        raise TargetError(f"--rpa-target={name}: RPA_HARNESS_PRECISION: {error}") from None


def _product_precision(name: str, profile: types.ModuleType) -> str:
    product_precision = getattr(profile, "RPA_HARNESS_PRODUCT_PRECISION", HIGHEST_PRODUCTS)
    if product_precision not in (HIGHEST_PRODUCTS, DEFAULT_PRODUCTS):
        raise TargetError(
            f"--rpa-target={name}: RPA_HARNESS_PRODUCT_PRECISION is {product_precision!r}; declare "
            f"{HIGHEST_PRODUCTS!r} (its float32 products pass precision=HIGHEST) or {DEFAULT_PRODUCTS!r} "
            "(they pass DEFAULT or none: one bfloat16 pass on a TPU)"
        )
    return product_precision


def _rules(name: str, module: types.ModuleType, profile: types.ModuleType) -> dict:
    """The declared rule table, checked, and checkable: dynamic rules need the module's validator."""
    try:
        rules = check_table(
            getattr(profile, "RPA_HARNESS_RULES", RULES), f"--rpa-target={name}: RPA_HARNESS_RULES"
        )
    except ValueError as error:
        raise TargetError(str(error)) from None
    dynamic = sorted(rule for rule, entry in rules.items() if entry.stage == "dynamic")
    if dynamic and not callable(
        getattr(module, VALIDATOR, None)
    ):  # Target.has_validator, before there is one
        table = "its RPA_HARNESS_RULES" if rules is not RULES else "the specification's rule table"
        raise TargetError(
            f"--rpa-target={name}: it has no {VALIDATOR}, but {table} has {len(dynamic)} dynamic rules "
            f"({', '.join(dynamic[:3])}{', ...' if len(dynamic) > 3 else ''}); define {VALIDATOR}, or declare "
            "RPA_HARNESS_RULES with the kernel's static rules only (docs/targets.md)"
        )
    return rules


def _updates_cache(name: str, profile: types.ModuleType) -> bool:
    updates_cache = getattr(profile, "RPA_HARNESS_UPDATES_CACHE", False)
    if not isinstance(updates_cache, bool):
        raise TargetError(
            f"--rpa-target={name}: RPA_HARNESS_UPDATES_CACHE is {updates_cache!r}; declare True (its "
            "ragged_paged_attention returns the attention and the updated kv_pages) or leave it out"
        )
    return updates_cache


def _known_issues(
    name: str, profile: types.ModuleType, capabilities: Capabilities
) -> tuple[tuple, tuple, dict]:
    """(the known issues whose cases are not drawn, every issue a failure may be named by, the kernel of
    each of those by name)."""
    own_catalogue = tuple(getattr(profile, "RPA_HARNESS_CATALOGUE", ()))
    shipped = shipped_findings()
    where = f"--rpa-target={name}: RPA_HARNESS_KNOWN_ISSUES"
    try:
        issues = known_issues.resolve(
            getattr(profile, "RPA_HARNESS_KNOWN_ISSUES", ()),
            where,
            own_catalogue + tuple(issue for issue, _ in shipped),
        )
    except known_issues.KnownIssueError as error:
        raise TargetError(str(error)) from None
    # A failure names the catalogued issues that fit it: the target's own first, then every shipped
    # catalogue's (a fork of v3 shares v3's bugs, a fork of upstream upstream's), then its own declared ones.
    # An issue of its own catalogue or declaration is of its own kernel; a shipped one of the shipped target.
    own = known_issues.Kernel(name, bool(capabilities.value_head_dims))
    catalogue: tuple = ()
    kernels: dict[str, known_issues.Kernel] = {}
    for issue, kernel in [(i, own) for i in own_catalogue] + list(shipped) + [(i, own) for i in issues]:
        if issue.name not in kernels:
            catalogue += (issue,)
            kernels[issue.name] = kernel
    return issues, catalogue, kernels


# What an optional function of the profile is, said when it declares something else.
_DECLARE_HOOK = "a function of the generation name that returns a context manager"
_DECLARE_COMPILED_CALL = (
    "a function (arrays, options) -> (kernel function, positional arguments), or leave it out"
)
_DECLARE_REPORT = (
    "a function that renders the report (rpa_harness.targets docstring), or leave it out for upstream's "
    "API's report"
)


def _optional_function(name: str, profile: types.ModuleType, attribute: str, declare: str) -> Callable | None:
    function = getattr(profile, attribute, None)
    if function is not None and not callable(function):
        raise TargetError(f"--rpa-target={name}: {attribute} is {function!r}; declare {declare}")
    return function


def _properties(name: str, profile: types.ModuleType) -> dict:
    properties = getattr(profile, "RPA_HARNESS_PROPERTIES", {})
    if not isinstance(properties, dict) or not all(
        isinstance(kind, str) and kind not in property_names.KINDS and callable(check)
        for kind, check in properties.items()
    ):
        raise TargetError(
            f"--rpa-target={name}: RPA_HARNESS_PROPERTIES is {properties!r}; declare a dict of kind -> "
            f"check(target, backend, arrays, options), kinds other than the built-in {', '.join(property_names.KINDS)}"
        )
    return properties


def _baseline(name: str, profile: types.ModuleType) -> str | None:
    baseline = getattr(profile, "RPA_HARNESS_BASELINE", None)
    if baseline is not None and not isinstance(baseline, str):
        raise TargetError(
            f"--rpa-target={name}: RPA_HARNESS_BASELINE is {baseline!r}; declare the module name of the target "
            "`rpa-harness bench` compares it with, or leave it out (upstream's kernel)"
        )
    return baseline


def _tuning_findings(name: str, profile: types.ModuleType) -> tuple:
    declared = getattr(profile, "RPA_HARNESS_TUNING_FINDINGS", ())
    entries = tuple(declared) if isinstance(declared, (tuple, list)) else (declared,)
    wrong = [entry for entry in entries if not isinstance(entry, known_issues.TuningFinding)]
    if wrong:
        raise TargetError(
            f"--rpa-target={name}: RPA_HARNESS_TUNING_FINDINGS holds {wrong[0]!r}, which is no TuningFinding; "
            "declare a tuple of rpa_harness.known_issues.TuningFinding entries, or leave it out"
        )
    return entries


def first_line_of_error(error: BaseException) -> str:
    """The real exception behind a JaxRuntimeError is on the last line of its embedded traceback. An
    exception without a message (a bare ``assert``) says where it was raised instead."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if lines:
        return f"{type(error).__name__}: {lines[-1]}"[:300]
    frames = traceback.extract_tb(error.__traceback__)
    where = (
        f" (raised at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})"
        if frames
        else ""
    )
    return f"{type(error).__name__}{where}"[:300]
