"""The pytest plugin of rpa-harness (entry point ``pytest11``): options, Hypothesis profiles, fixtures.

Installed with the harness, so ``pytest --pyargs rpa_harness.properties --rpa-target=mypkg.rpa`` works in any
repo. It is loaded in every pytest run of an environment that has rpa-harness, so it acts only where the
harness runs: when an ``--rpa-*`` option or ``RPA_TARGET`` is given, when the run collects the shipped
properties (``rpa_harness.properties``), or when the ini option ``rpa_harness = true`` says so (this repo's
pyproject.toml). Elsewhere it registers its options and profiles and does nothing else: it loads no
Hypothesis profile and imports no target.

Options (each also read from an environment variable):
  --rpa-target=MODULE[,MODULE...]
                                RPA_TARGET          the kernel module(s) under test (default: rpa_harness.kernel);
                                                    repeatable: several targets run in one session, each test
                                                    once per target, its id naming the target
  --rpa-backend=NAME            RPA_BACKEND         interpret | fast-interpret | tpu | auto (default: auto)
  --rpa-repro-dir=DIR           RPA_REPRO_DIR       where failing examples are written (default: rpa-repros)
  --rpa-interpreter-compat=on|off                   patch the interpreters' known gaps (default: on)
  --rpa-allow-no-numeric        RPA_ALLOW_NO_NUMERIC=1  a run in which no numeric property ran may pass
  --rpa-precision=NAME[,NAME]   RPA_PRECISION       precision contract(s) the target is judged under
                                                    (default: its RPA_HARNESS_PRECISION, else float32)
  --rpa-compilation-cache=DIR|off
                                RPA_COMPILATION_CACHE  jax's persistent compilation cache (default:
                                                    .jax-compilation-cache; created if missing)
  --rpa-buckets=NAME[,NAME...]  RPA_BUCKETS         shape buckets drawn (default: tiny,small; the ci
                                                    profile adds long, the nightly profile long and
                                                    production), within the target's declared
                                                    Capabilities.buckets (none of them: a usage error)
  --rpa-known-issues=auto|none|NAME[,NAME...]
                                RPA_KNOWN_ISSUES    known issues whose cases are not drawn (default: auto, the
                                                    target's declaration; see rpa_harness/targets/)
  --rpa-tpu-generation=auto|none|NAME[,NAME...]
                                RPA_TPU_GENERATION  TPU generations the interpreters emulate (default: auto,
                                                    the target's declared tpu_generations; see
                                                    rpa_harness.generations)
  --rpa-chip-owner=auto|on|off RPA_CHIP_OWNER      one process makes every kernel call for the xdist workers
                                                    (default: auto, on the tpu backend with -n 2 or more;
                                                    on: on any backend; off: -n 1 on the tpu backend)
  --rpa-chip-owners=N|auto      RPA_CHIP_OWNERS     how many chip owners, one chip each, the workers spread
                                                    over them (default: auto, one per chip of the host on
                                                    the tpu backend, else 1; at most one per worker)
  --rpa-seconds=S               RPA_SECONDS         seconds the run's targets share: each is given what is left
                                                    over the targets still to run, and a test of a target past
                                                    its share is skipped (default: no limit)
Profiles (--hypothesis-profile or HYPOTHESIS_PROFILE): dev (default), ci, nightly, repro;
RPA_MAX_EXAMPLES resizes the chosen profile's base example count.

Capabilities are resolved here, once: tests that run the target's kernel and compare numbers carry the
``rpa_numeric`` marker (added to every test that uses ``volume_backend`` or ``checking_backend``, whose
fixtures skip a backend that is absent or that the target declares it does not run on), and a test that
needs an opt-in capability carries ``rpa_requires("name", reason=...)``.
"""

import itertools
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    GitHubArtifactDatabase,
    MultiplexedDatabase,
    ReadOnlyDatabase,
)

from rpa_harness import checks, device, generations, known_issues, repro, runlog, targets
from rpa_harness.recording import DEVICE_HALTED, CannotRunHere, preceded_by_line
from rpa_harness.reference.tolerance import BF16_MATMUL, CONTRACTS, TPU_TRANSCENDENTALS
from rpa_harness.run_settings import CLI_TERMS_ENV, RunSettings, SettingError, from_options, in_cli_terms

DATABASE_DIR = os.environ.get("RPA_HYPOTHESIS_DB", ".hypothesis/examples")
# Other example databases a nightly shard also replays, read-only: comma-separated folders (another
# shard's, a restored cache) or github:OWNER/REPO[/ARTIFACT] (the database a repository's CI uploaded as an
# artifact, hypothesis' GitHubArtifactDatabase; default artifact hypothesis-example-db).
SHARED_DATABASES_ENV = "RPA_HYPOTHESIS_DB_READ"
# Where a chip owner makes the calls of N workers, each volume property (the pooled and whole-space
# differential ones, ``volume_shard``) runs as N items, one a worker, each drawing its own examples: one
# Hypothesis test runs in one process, and would keep one worker busy while the others and the chip wait.
VOLUME_SHARDS_ENV = "RPA_VOLUME_SHARDS"


def example_database(folder: str, shared: str = "") -> ExampleDatabase:
    """The nightly and repro profiles' database: ``folder`` (read and written: on shared storage, every shard
    on every machine saves its failures there and replays the others' first), multiplexed with the
    read-only ``shared`` sources (``SHARED_DATABASES_ENV``)."""
    local = DirectoryBasedExampleDatabase(folder)
    sources: list[ExampleDatabase] = []
    for entry in filter(None, (part.strip() for part in shared.split(","))):
        if entry.startswith("github:"):
            owner, _, rest = entry.removeprefix("github:").partition("/")
            repo, _, artifact = rest.partition("/")
            if not owner or not repo:
                raise pytest.UsageError(
                    f"{SHARED_DATABASES_ENV}: {entry!r} is not github:OWNER/REPO[/ARTIFACT]; e.g. github:me/kernels"
                )
            sources.append(GitHubArtifactDatabase(owner, repo, artifact or "hypothesis-example-db"))
        else:
            sources.append(DirectoryBasedExampleDatabase(entry))
    if not sources:
        return local
    return MultiplexedDatabase(local, *(ReadOnlyDatabase(source) for source in sources))


def register_profiles() -> None:
    """The harness's Hypothesis profiles. Registered only when the plugin is active: ``ci`` replaces
    Hypothesis' built-in profile of that name, which a user's own suite gets on CI."""
    _common: dict[str, Any] = dict(
        deadline=None,  # the first call of each shape compiles
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    # No profile runs the `explain` phase: it re-runs the kernel, and its report lengthens every failure.
    settings.register_profile(
        "dev", max_examples=10, phases=[Phase.explicit, Phase.generate, Phase.target, Phase.shrink], **_common
    )
    settings.register_profile(
        "ci",
        max_examples=40,
        derandomize=True,  # also means database=None: every CI run sees the same examples
        phases=[
            Phase.explicit,
            Phase.generate,
            Phase.target,
            Phase.shrink,
        ],
        **_common,
    )
    settings.register_profile(
        "nightly",
        max_examples=400,  # per round; ci/nightly_tpu.sh repeats rounds until its time budget is spent
        database=example_database(DATABASE_DIR, os.environ.get(SHARED_DATABASES_ENV, "")),
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        **_common,
    )
    settings.register_profile(
        "repro",
        database=example_database(DATABASE_DIR, os.environ.get(SHARED_DATABASES_ENV, "")),
        phases=[Phase.explicit, Phase.reuse],  # replay the saved failures, generate nothing
        **_common,
    )


def pytest_addoption(parser):
    parser.addini(
        "rpa_harness", type="bool", default=False,
        help="run the rpa-harness plugin in this repo's every pytest run (default: only when the run names an "
        "--rpa-* option or RPA_TARGET, or collects rpa_harness.properties)",
    )  # fmt: skip
    group = parser.getgroup("rpa-harness")
    group.addoption(
        "--rpa-target",
        action="append",
        default=None,
        help="module with ragged_paged_attention and dynamic_validate_inputs, or several comma-separated; "
        "repeatable: every property runs once per target in one session (default: RPA_TARGET, else "
        f"{targets.DEFAULT_TARGET})",
    )
    group.addoption(
        TARGET_SECONDS_OPTION,
        default=os.environ.get("RPA_SECONDS", ""),
        help="seconds the run's targets share: each is given what is left over the targets still to run, and "
        "the tests of a target past its share are skipped (default: no limit)",
    )
    group.addoption(
        "--rpa-backend",
        default=os.environ.get("RPA_BACKEND", device.AUTO),
        choices=(*device.BACKENDS, device.AUTO),
        help="auto: tpu when a TPU is present, else both interpreters",
    )
    group.addoption(
        "--rpa-repro-dir",
        default=os.environ.get("RPA_REPRO_DIR", repro.DEFAULT_REPRO_DIR),
        help="directory for repro files of failing properties (default: rpa-repros)",
    )
    group.addoption(
        "--rpa-interpreter-compat",
        default="on",
        choices=("on", "off"),
        help="patch the interpreters' known gaps (rpa_harness.interpret_compat; default: on)",
    )
    group.addoption(
        "--rpa-precision",
        default=os.environ.get("RPA_PRECISION", ""),
        help=f"precision contract(s) the target is judged under, comma-separated ({', '.join(CONTRACTS)}; "
        "default: the target's RPA_HARNESS_PRECISION, else float32)",
    )
    group.addoption(
        known_issues.OPTION,
        default=os.environ.get("RPA_KNOWN_ISSUES", known_issues.AUTO),
        help="auto (the target's RPA_HARNESS_KNOWN_ISSUES), none, or NAME[,NAME...]: known issues whose "
        "cases are not drawn and whose repros must still fail",
    )
    group.addoption(
        known_issues.PREDICT_CHIP_OPTION,
        action="store_true",
        default=False,
        help="on an interpreter emulating a TPU generation, the known-issue property predicts that chip's "
        "verdicts: the repro a chip of it replays, compiled first for it where libtpu is installed (a refusal "
        "another finding predicts masks it), a halt's on the checking interpreter (rpa-harness chip verdicts "
        "passes it)",
    )
    group.addoption(
        "--rpa-compilation-cache",
        default=os.environ.get(device.COMPILATION_CACHE_ENV, device.DEFAULT_COMPILATION_CACHE),
        help="folder of jax's persistent compilation cache, or off (default: "
        f"{device.DEFAULT_COMPILATION_CACHE}; created if missing)",
    )
    group.addoption(
        BUCKETS_OPTION,
        default=os.environ.get("RPA_BUCKETS", ""),
        help="shape buckets to draw, comma-separated (default: tiny,small, plus long under the ci profile and "
        "long,production under the nightly one); only the target's declared Capabilities.buckets are drawn",
    )
    group.addoption(
        generations.OPTION,
        default=os.environ.get(generations.ENV, generations.AUTO),
        help="TPU generation(s) the interpreters emulate while the kernel is traced, comma-separated "
        f"({', '.join(generations.DEVICE_KINDS)}), none (a CPU device), or auto (default: the target's "
        f"Capabilities.tpu_generations, {' and '.join(generations.EVERYDAY_GENERATIONS)} of them except "
        "under the nightly profile; none if it declares none); each is its own parametrisation",
    )
    group.addoption(
        "--rpa-chip-owner",
        default=os.environ.get("RPA_CHIP_OWNER", "auto"),
        choices=("auto", "on", "off"),
        help="one process makes every kernel call while the xdist workers draw, build arrays and judge "
        "(rpa_harness.device.owner; default auto: on the tpu backend with -n 2 or more; on: on any backend, "
        "the interpreters standing in for the chip; off: the tpu backend runs one worker)",
    )
    group.addoption(
        CHIP_OWNERS_OPTION,
        default=os.environ.get("RPA_CHIP_OWNERS", "auto"),
        help="how many chip owners the run starts, each pinned to one chip of the host (libtpu's "
        "TPU_VISIBLE_CHIPS), worker i sending its calls to owner i mod N; auto (default): one per chip of the "
        "host on the tpu backend (counted from /dev/accel* or /dev/vfio), else 1; at most one per worker",
    )
    group.addoption(
        "--rpa-allow-no-numeric",
        action="store_true",
        default=os.environ.get("RPA_ALLOW_NO_NUMERIC", "") not in ("", "0"),
        help="let a run pass in which every numeric property was skipped (default: such a run exits 5)",
    )


BUCKETS_OPTION = "--rpa-buckets"
CHIP_OWNERS_OPTION = "--rpa-chip-owners"
TARGET_SECONDS_OPTION = "--rpa-seconds"
# The moment the run's targets' time (``--rpa-seconds``) ends, as the process that started the run set it: its
# xdist workers, started later, share it.
TARGETS_DEADLINE_ENV = "RPA_TARGETS_DEADLINE"


NUMERIC = "rpa_numeric"
REQUIRES = "rpa_requires"
TARGET_MARK = "rpa_target"  # on each test of a run of several targets: the target it runs against
NO_NUMERIC_EXIT = pytest.ExitCode.NO_TESTS_COLLECTED  # 5: the target's numbers were never checked


def _properties_dirs() -> list[Path]:
    """Where the shipped properties are: the installed package, and tests/properties in a checkout."""
    import rpa_harness.properties

    return [Path(path).resolve() for path in rpa_harness.properties.__path__]


def _names_the_harness(config) -> bool:
    if config.getini("rpa_harness") or os.environ.get("RPA_TARGET"):
        return True
    arguments = [str(a) for a in config.invocation_params.args]
    if any(a.startswith("--rpa-") or a.startswith("rpa_harness") for a in arguments):
        return True
    properties = _properties_dirs()
    for argument in config.args:
        path = Path(str(argument).split("::", 1)[0]).resolve()
        if any(path == folder or folder in path.parents or path in folder.parents for folder in properties):
            return True
    return False


ACTIVE = pytest.StashKey[bool]()
SETTINGS = pytest.StashKey[tuple[RunSettings, ...]]()  # one per target, in the order they were named


def _active(config) -> bool:
    return config.stash.get(ACTIVE, False)


def settings_of(config, target=None) -> RunSettings:
    """The run's settings for ``target`` (a target or its name; default: the first the run names), resolved
    once when the session is configured (``rpa_harness.run_settings``)."""
    every = config.stash[SETTINGS]
    if target is None:
        return every[0]
    name = getattr(target, "name", target)
    for run in every:
        if run.target.name == name:
            return run
    raise LookupError(f"target {name} is not one this run serves ({', '.join(r.target.name for r in every)})")


def every_settings(config) -> tuple[RunSettings, ...]:
    """The settings of each target the run serves, in the order they were named."""
    return config.stash[SETTINGS]


def _serves_several_targets(config) -> bool:
    return len(config.stash[SETTINGS]) > 1


def target_names(config) -> list[str]:
    """The targets the run names (``--rpa-target``, repeated or comma-separated, else ``RPA_TARGET``), each
    once, in order."""
    given = config.getoption("--rpa-target") or [os.environ.get("RPA_TARGET") or targets.DEFAULT_TARGET]
    names = [name.strip() for value in given for name in value.split(",")]
    return list(dict.fromkeys(name for name in names if name))


def target_ids(names) -> dict[str, str]:
    """Each target's part of a test id where a run serves several: the shortest tail of its module name that
    no other target's ends with (``kernel`` for rpa_harness.kernel), so that ``-k kernel`` selects it."""
    ids = {}
    for name in names:
        parts = name.split(".")
        for length in range(1, len(parts) + 1):
            tail = ".".join(parts[-length:])
            if not any(other != name and (other == tail or other.endswith(f".{tail}")) for other in names):
                break
        ids[name] = tail
    return ids


@pytest.hookimpl(tryfirst=True)  # before Hypothesis's plugin loads --hypothesis-profile
def pytest_configure(config):
    config.stash[ACTIVE] = _names_the_harness(config)
    if config.stash[ACTIVE]:
        register_profiles()


@pytest.hookimpl(trylast=True, specname="pytest_configure")  # after Hypothesis's plugin loaded the profile
def pytest_configure_after_hypothesis(config):
    if not _active(config):
        return
    if not config.getoption("--hypothesis-profile", None):
        settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
    config.addinivalue_line(
        "markers",
        f"{NUMERIC}: runs the target's kernel and checks its output (set by the plugin at collection)",
    )
    config.addinivalue_line(
        "markers", f"{REQUIRES}(capability, reason=None): skip unless the target's Capabilities opt in"
    )
    config.addinivalue_line(
        "markers", f"{TARGET_MARK}(name): the target this test runs against (set by the plugin at collection)"
    )
    profile = settings.get_current_profile_name()  # before RPA_MAX_EXAMPLES renames it "sized"
    if os.environ.get("RPA_MAX_EXAMPLES"):  # resize the chosen profile (benchmarks, long local runs)
        settings.register_profile(
            "sized", parent=settings.default, max_examples=int(os.environ["RPA_MAX_EXAMPLES"])
        )
        settings.load_profile("sized")
    _check_folders(config)
    if _is_controller(config):  # before anything here can initialise jax (a target computing at import)
        device.keep_off_the_chips()
    _use_compilation_cache(config)
    _one_blas_thread_per_worker(config)
    os.environ.update(device.faster_cpu_compilation(os.environ))  # before the target computes anything
    try:
        every = [
            from_options(
                target=name,
                backend=config.getoption("--rpa-backend"),
                interpreter_compat=config.getoption("--rpa-interpreter-compat") == "on",
                precision=config.getoption("--rpa-precision"),
                known_issue_names=config.getoption(known_issues.OPTION),
                buckets=config.getoption(BUCKETS_OPTION),
                tpu_generation=config.getoption(generations.OPTION),
                profile=profile,
            )
            for name in target_names(config)
        ]
    except SettingError as error:
        raise pytest.UsageError(
            in_cli_terms(str(error)) if os.environ.get(CLI_TERMS_ENV) else str(error)
        ) from None
    once: dict[str, RunSettings] = {}  # an alias and the module it names load as one target: it runs once
    for run in every:
        once.setdefault(run.target.name, run)
    config.stash[SETTINGS] = tuple(once.values())
    _share_the_targets_time(config)
    _chip_owner_or_one_worker(config)
    # Where the run has a chip owner, it makes this process's kernel calls: a worker finds its address in the
    # environment the controller started it with (all the owners' where there is one a chip: each call takes
    # this worker's, ``device.owner.address``).
    device.owner.route_calls_to(os.environ.get(device.owner.ADDRESS_ENV))
    _name_the_chip(config)
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        device.set_output_release(lambda: capture.suspend_global_capture(in_=False))
    config.pluginmanager.register(RunVerdicts(config), "rpa-harness-verdicts")


TARGET_CUTOFFS = pytest.StashKey[dict[str, float]]()  # in each process: when each target's share ends


def _share_the_targets_time(config) -> None:
    """Starts the clock of ``--rpa-seconds``: the process that starts the run fixes the moment the targets'
    time ends, and its xdist workers (started from its environment) keep it."""
    config.stash[TARGET_CUTOFFS] = {}
    seconds = config.getoption(TARGET_SECONDS_OPTION)
    if not seconds or _is_worker(config):
        return
    try:
        budget = float(seconds)
    except ValueError:
        raise pytest.UsageError(
            f"{TARGET_SECONDS_OPTION}={seconds} (or RPA_SECONDS): not a number of seconds; pass e.g. "
            f"{TARGET_SECONDS_OPTION}=300"
        ) from None
    os.environ[TARGETS_DEADLINE_ENV] = str(time.time() + budget)


def target_share_ends(deadline: float, now: float, targets_left: int) -> float:
    """When a target starting now stops: it is given what is left until ``deadline`` divided by the targets
    still to run, itself included, so that a quick one leaves its time to those after it."""
    return now + max(deadline - now, 0.0) / targets_left


def _skip_past_the_targets_share(item, run: RunSettings) -> None:
    """Skips a test of a target whose share of ``--rpa-seconds`` is spent, as this process sees it: the share
    starts with the target's first test here (pytest runs a target's tests together)."""
    deadline = os.environ.get(TARGETS_DEADLINE_ENV)
    if not deadline or not item.config.getoption(TARGET_SECONDS_OPTION):
        return
    cutoffs, now, name = item.config.stash[TARGET_CUTOFFS], time.time(), run.target.name
    if name not in cutoffs:
        names = [each.target.name for each in every_settings(item.config)]
        cutoffs[name] = target_share_ends(float(deadline), now, len(names) - names.index(name))
    if now >= cutoffs[name]:
        pytest.skip(
            f"target {name} is past its share of the run's {item.config.getoption(TARGET_SECONDS_OPTION)} s "
            f"({TARGET_SECONDS_OPTION})"
        )


def _is_controller(config) -> bool:
    """Whether this process is pytest-xdist's controller: it starts workers and runs no test itself."""
    return (
        not _is_worker(config)
        and config.getoption("dist", "no") != "no"
        and bool(config.getoption("tx", None))
    )


def _on_a_tpu(config) -> bool:
    return any(backend.name == device.TPU for backend in settings_of(config).backends)


WORKERS_ASKED = pytest.StashKey[int]()
OWNER = pytest.StashKey[device.owner.Owners]()
OWNER_CHIPS = pytest.StashKey[list]()  # the chips the owners hold, as the run log's device events name them


def _chip_owner_or_one_worker(config) -> None:
    """In the controller: with several workers on the tpu backend (or ``--rpa-chip-owner=on``), a chip
    owner makes every kernel call (``rpa_harness.device.owner``) and the workers feed it; else one worker on
    the tpu backend, whatever ``-n`` asked: a process opens every chip of its host (libtpu's lockfile), so
    a second worker could open none. The header says which."""
    if not _is_controller(config):
        return
    choice, workers = config.getoption("--rpa-chip-owner"), len(config.option.tx)
    if choice == "on" or (choice == "auto" and _on_a_tpu(config) and workers > 1):
        _start_chip_owner(config)
    elif _on_a_tpu(config) and workers > 1:
        config.option.tx = config.option.tx[:1]
        config.option.numprocesses = 1
        config.stash[WORKERS_ASKED] = workers


def _chip_owners_wanted(config) -> int:
    """How many chip owners the run starts (``--rpa-chip-owners``): the number given, or for auto one per chip
    the host has on the tpu backend (``device.chips_on_this_host``) and one elsewhere; never more than the
    workers, since an owner no worker feeds would hold a chip for nothing."""
    choice = config.getoption(CHIP_OWNERS_OPTION).strip().lower()
    chips = device.chips_on_this_host() if _on_a_tpu(config) else 0
    if choice == "auto":
        wanted = max(chips, 1)
    elif choice.isdigit() and int(choice) >= 1:
        wanted = int(choice)
    else:
        raise pytest.UsageError(
            f"{CHIP_OWNERS_OPTION}={choice!r} is not a number of chip owners; pass a number from 1 up, or auto "
            "(one per chip of the host on the tpu backend)"
        )
    if chips and wanted > chips:
        raise pytest.UsageError(
            f"{CHIP_OWNERS_OPTION}={wanted}: this host has {chips} TPU chip(s) (/dev/accel*, /dev/vfio), one "
            f"owner a chip; pass {chips} or fewer, or auto"
        )
    return min(wanted, len(config.option.tx))


def _start_chip_owner(config) -> None:
    """Starts the owners, one per chip, and points the workers at them (they start after configuration, from
    this process's environment, each taking its owner from it); on a chip they compute on the CPU and take
    the chips' description from the owners."""
    environ = dict(os.environ)
    folder = device.compilation_cache_setting(config.getoption("--rpa-compilation-cache"))
    environ[device.COMPILATION_CACHE_ENV] = str(folder) if folder is not None else "off"
    owners = device.owner.Owners(environ, _chip_owners_wanted(config)).start()
    try:
        facts = owners.facts()
    except device.owner.OwnerUnavailable as error:
        owners.stop()
        pytest.exit(f"rpa-harness: {device.CHIP_FAULTED}: {error}", returncode=device.CHIP_FAULTED_EXIT_CODE)
    config.stash[OWNER] = owners
    device.owner.route_calls_to(owners.where)
    loaded = settings.default
    assert loaded is not None  # None only while Hypothesis itself is imported
    if not loaded.derandomize:  # derandomized shards would all draw the same examples
        os.environ[VOLUME_SHARDS_ENV] = str(len(config.option.tx))
    chips = sum(owner["tpu_count"] for owner in facts)
    if chips:
        kind = facts[0]["tpu_kind"]
        config.stash[OWNER_CHIPS] = [{"device_kind": kind, "count": chips}]
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ[device.TPU_PROBE_ENV] = f"{kind}:{chips}"


def pytest_unconfigure(config):
    owners = config.stash.get(OWNER, None)
    if owners is not None:
        owners.stop()


def _name_the_chip(config) -> None:
    """A process that opened the chip names it in the run log: the summary's header takes the chip from there,
    since the controller never opens it."""
    if _is_controller(config) or not _on_a_tpu(config):
        return
    tpus = device.tpus()
    worker = getattr(config, "workerinput", {}).get("workerid", "")
    runlog.record_event("device", device_kind=tpus.kind, count=tpus.count, worker=worker)


def _usable_folder(path, setting: str) -> None:
    """Creates the folder if needed and checks that a file can be written in it, before anything runs."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise pytest.UsageError(
            f"{setting}={path}: cannot write there ({type(error).__name__}: {error.strerror or error}); "
            "pass a writable folder"
        ) from None


def _check_folders(config) -> None:
    """The harness's own folders are usage errors, never failures of a property.

    The repro folder, the run log (RPA_RUN_LOG) and a nightly example database are created when missing;
    the ``repro`` profile replays a database, so there its folder must exist already.
    """
    _usable_folder(config.getoption("--rpa-repro-dir"), "--rpa-repro-dir")
    if os.environ.get(runlog.ENV):
        _usable_folder(os.environ[runlog.ENV], runlog.ENV)
    loaded = settings.default
    assert loaded is not None  # None only while Hypothesis itself is imported
    database = loaded.database
    # Ours is multiplexed when shards share other databases: the folder it writes is DATABASE_DIR.
    path = DATABASE_DIR if isinstance(database, MultiplexedDatabase) else getattr(database, "path", None)
    if isinstance(database, DirectoryBasedExampleDatabase | MultiplexedDatabase) and path is not None:
        if settings.get_current_profile_name() == "repro" and not Path(path).is_dir():
            raise pytest.UsageError(
                f"RPA_HYPOTHESIS_DB={path}: no such folder, so the repro profile has nothing to replay; "
                "point it at the example database a nightly run saved"
            )
        _usable_folder(path, "RPA_HYPOTHESIS_DB")


def _use_compilation_cache(config) -> None:
    """jax's persistent compilation cache (``rpa_harness/device/compilation.py``), its folder checked like the others;
    each process counts its compilations and cache hits for the run log."""
    device.count_compilations()
    folder = device.compilation_cache_setting(config.getoption("--rpa-compilation-cache"))
    if folder is not None:
        _usable_folder(folder, "--rpa-compilation-cache")
        device.enable_compilation_cache(folder)


def _one_blas_thread_per_worker(config) -> None:
    """With xdist workers, each starts with one BLAS thread (``device.one_blas_thread_per_worker``); the
    workers are started after configuration, from this process's environment."""
    workers = config.getoption("numprocesses", None)
    is_worker = hasattr(config, "workerinput")  # not the environment: a run inside a worker inherits it
    if isinstance(workers, int) and workers > 1 and not is_worker:
        os.environ.update(device.one_blas_thread_per_worker(os.environ))


VOLUME = (device.FAST_INTERPRET, device.TPU)
CHECKING = (device.INTERPRET, device.TPU)


# In a run of several targets, the parametrizations that depend on the target, while pytest_generate_tests
# runs for a test function: (argnames, params_of, indirect) each, made jointly with the target afterwards.
_PER_TARGET: dict[pytest.Metafunc, list] = {}


def parametrize_per_target(metafunc, argnames, params_of, **parametrize) -> None:
    """Parametrizes ``argnames`` with ``params_of(run_settings)`` (a list of ``pytest.param``), the values a
    target's settings give: at once where the run serves one target (its ids as they always were); where it
    serves several, jointly with ``target`` once the test's every parametrization is known, each target's
    tests with that target's own values, their ids led by the target's (``target_ids``)."""
    if metafunc not in _PER_TARGET:
        metafunc.parametrize(argnames, params_of(settings_of(metafunc.config)), **parametrize)
        return
    names = (argnames,) if isinstance(argnames, str) else tuple(argnames)
    _PER_TARGET[metafunc].append((names, params_of, bool(parametrize.get("indirect"))))


@pytest.hookimpl(wrapper=True, specname="pytest_generate_tests")
def pytest_generate_tests_with_every_target(metafunc):
    """Where the run serves several targets, a test that uses ``target`` runs once per target: ``target`` is
    parametrized together with what ``parametrize_per_target`` was given for it (pytest's separate
    parametrizations would pair each target with every other's backends, known issues and rules)."""
    config = metafunc.config
    if not (_active(config) and _serves_several_targets(config) and "target" in metafunc.fixturenames):
        return (yield)
    _PER_TARGET[metafunc] = []
    try:
        generated = yield
    finally:
        pending = _PER_TARGET.pop(metafunc)
    names = ("target", *(name for argnames, _, _ in pending for name in argnames))
    indirect = ["target", *(name for argnames, _, by_fixture in pending if by_fixture for name in argnames)]
    every = every_settings(config)
    ids = target_ids([run.target.name for run in every])
    params = []
    for run in every:
        for combination in itertools.product(*(params_of(run) for _, params_of, _ in pending)):
            parts = [ids[run.target.name]]
            parts += [p.id if p.id is not None else "-".join(map(str, p.values)) for p in combination]
            params.append(
                pytest.param(
                    run.target.name,
                    *(value for p in combination for value in p.values),
                    marks=[getattr(pytest.mark, TARGET_MARK)(run.target.name)]
                    + [mark for p in combination for mark in p.marks],
                    id="-".join(parts),
                )
            )
    metafunc.parametrize(names, params, indirect=indirect, scope="session")
    return generated


def _backends_of(kinds):
    """``params_of`` for a backend fixture: the target's chosen backends of ``kinds``."""
    return lambda run: [pytest.param(b, id=b.label) for b in run.backends if b.name in kinds]


def _compilers_of(run: RunSettings) -> list:
    """``params_of`` for ``compile_backend``: this host's TPU compiler for each generation the target's
    compile property compiles for."""
    compilers = [
        device.Backend(device.TPU_COMPILER, run.interpreter_compat, generation)
        for generation in run.compile_generations
    ]
    return [pytest.param(b, id=b.label) for b in compilers]


def pytest_generate_tests(metafunc):
    """``volume_backend``: where many examples run; ``checking_backend``: where memory safety is checked;
    ``replay_backend``: every chosen backend (a repro replayed once on each); each the target's own."""
    if not _active(metafunc.config):
        return
    for fixture, kinds in (
        ("volume_backend", VOLUME),
        ("checking_backend", CHECKING),
        ("replay_backend", device.BACKENDS),
    ):
        if fixture in metafunc.fixturenames:
            parametrize_per_target(metafunc, fixture, _backends_of(kinds), scope="session", indirect=True)
    shards = int(os.environ.get(VOLUME_SHARDS_ENV, "1"))
    if "volume_shard" in metafunc.fixturenames and shards > 1:
        metafunc.parametrize(
            "volume_shard",
            range(shards),
            ids=[f"shard{k + 1}of{shards}" for k in range(shards)],
            indirect=True,
            scope="session",
        )
    if "compile_backend" in metafunc.fixturenames:
        parametrize_per_target(metafunc, "compile_backend", _compilers_of, scope="session", indirect=True)


def _example_budget(item) -> int | None:
    """The max_examples a Hypothesis property runs with (its own @settings, else the loaded profile's)."""
    function = getattr(item, "obj", None)
    if not getattr(function, "is_hypothesis_test", False):
        return None
    own = getattr(function, "_hypothesis_internal_use_settings", None)
    loaded = settings.default
    assert loaded is not None  # None only while Hypothesis itself is imported
    return (own or loaded).max_examples


def pytest_collection_finish(session):
    """The selected properties' example budgets, for ``rpa-harness run``'s progress (after -k and markers)."""
    if not _active(session.config) or not os.environ.get(runlog.ENV):
        return
    for item in session.items:
        budget = _example_budget(item)
        if budget is not None:
            runlog.record_plan(item.nodeid, budget)


def pytest_collection_modifyitems(config, items):
    if not _active(config):
        return
    for item in items:
        if {"volume_backend", "checking_backend"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(NUMERIC)


def settings_of_item(item) -> RunSettings:
    """The settings of the target a collected test runs against: in a run of several, the one its
    ``TARGET_MARK`` names (a parameter of the test's own that happens to be called ``target`` is not one);
    a test that uses no target, or whose parameters are empty for every target: the first's."""
    marked = item.get_closest_marker(TARGET_MARK)
    return settings_of(item.config, marked.args[0] if marked is not None else None)


def pytest_runtest_setup(item):
    if not _active(item.config):
        return
    run = settings_of_item(item)
    target = run.target
    _skip_past_the_targets_share(item, run)
    for marker in item.iter_markers(REQUIRES):
        capability = marker.args[0]
        if not getattr(target.capabilities, capability):
            reason = marker.kwargs.get("reason") or f"needs the {capability} capability"
            pytest.skip(f"{reason} (target {target.name} does not opt in: {capability})")


def _runnable_backend(config, backend, target):
    """A backend the target can run on, or a skip with the declared reason (absent TPU, declared backends,
    a backend declared slow that --rpa-backend=auto chose)."""
    if backend.skip_reason:
        pytest.skip(backend.skip_reason)
    settings = settings_of(config, target)
    declared = checks.declared_unrunnable(target, backend, by_default=settings.backends_by_default)
    if declared:
        raise CannotRunHere(
            target.name, backend.name, in_cli_terms(declared) if os.environ.get(CLI_TERMS_ENV) else declared
        )
    return backend


@pytest.fixture(scope="session")
def volume_backend(request, pytestconfig, target):
    return _runnable_backend(pytestconfig, request.param, target)


@pytest.fixture(scope="session")
def volume_shard(request) -> int:
    """Which of the volume properties' shards this item is (``VOLUME_SHARDS_ENV``): 0 of 1 unless a chip
    owner makes the calls of several workers."""
    return getattr(request, "param", 0)


@pytest.fixture(scope="session")
def checking_backend(request, pytestconfig, target):
    return _runnable_backend(pytestconfig, request.param, target)


@pytest.fixture(scope="session")
def replay_backend(request, pytestconfig, target):
    return _runnable_backend(pytestconfig, request.param, target)


@pytest.fixture(scope="session")
def compile_backend(request, pytestconfig, target):
    """The TPU compiler on this host for one generation (``--rpa-tpu-generation``), or a skip that says
    what to install."""
    return _runnable_backend(pytestconfig, request.param, target)


@pytest.fixture(scope="session")
def target(request, pytestconfig):
    """The target under test, with the run's precision contract and known issues applied (in a run of
    several, the one this test's ``target`` parameter names)."""
    return settings_of(pytestconfig, getattr(request, "param", None)).target


@pytest.fixture(scope="session")
def bucket_selection(pytestconfig, target):
    """The buckets this run draws (``--rpa-buckets``, else the profile's defaults): the strategies'
    ``selection``."""
    return settings_of(pytestconfig, target).buckets


@pytest.fixture(scope="session")
def backend(pytestconfig, target):
    """The backend for properties that need one kernel run per example and no volume (the first chosen)."""
    return settings_of(pytestconfig, target).backends[0]


def repro_folders(config) -> list[Path]:
    """Where the run's repros go: ``--rpa-repro-dir``, in a run of several targets a folder in it per target,
    named by the target's module, so that the same property of two targets leaves two repros."""
    folder = Path(config.getoption("--rpa-repro-dir"))
    if not _serves_several_targets(config):
        return [folder]
    return [folder / run.target.name for run in every_settings(config)]


@pytest.fixture(scope="session")
def repro_dir(pytestconfig, target):
    folder = Path(pytestconfig.getoption("--rpa-repro-dir"))
    if not _serves_several_targets(pytestconfig):
        return folder
    (folder / target.name).mkdir(parents=True, exist_ok=True)
    return folder / target.name


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


CANNOT_RUN_PROPERTY = "rpa_cannot_run"  # (backend name, reason) in a report's user_properties
# In a run of several targets, the test's target in its report's user_properties.
TARGET_PROPERTY = "rpa_target"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip because the target cannot run on a backend carries the backend and the reason in the
    report's user_properties (which xdist sends to the controller with the report); in a run of several
    targets every report carries its target there."""
    report = yield
    if call.excinfo is not None and isinstance(call.excinfo.value, CannotRunHere):
        report.user_properties.append(
            (CANNOT_RUN_PROPERTY, (call.excinfo.value.backend_name, call.excinfo.value.reason))
        )
    if _active(item.config) and _serves_several_targets(item.config):
        report.user_properties.append((TARGET_PROPERTY, settings_of_item(item).target.name))
    return report


class TargetVerdicts:
    """One target's reports, as the process that sees every report counts them."""

    def __init__(self) -> None:
        self.outcomes: dict[str, int] = {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0}
        self.failed_tests: list[str] = []
        self.numeric_ran = self.numeric_skipped = 0
        self.cannot_run: dict[str, str] = {}  # backend name -> the first reason a numeric property gave

    def count(self, report) -> None:
        if report.failed:
            self.outcomes["failed"] += 1
            self.failed_tests.append(report.nodeid)
        elif report.skipped:
            self.outcomes["xfailed" if hasattr(report, "wasxfail") else "skipped"] += 1
        elif report.when == "call":
            self.outcomes["passed"] += 1

    def line(self, name: str) -> str:
        """``target NAME: 3 passed, 1 failed, ...``, the outcomes this target had."""
        counted = ", ".join(f"{n} {outcome}" for outcome, n in self.outcomes.items() if n)
        return f"target {name}: {counted or 'no test ran'}"


class RunVerdicts:
    """In the process that sees every report (the xdist controller, or the only one): for each target, how
    many numeric properties ran and were skipped, why it could not run on a backend, and its outcomes."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.started = time.time()
        self.targets = {run.target.name: TargetVerdicts() for run in every_settings(config)}

    def of(self, report) -> TargetVerdicts:
        """The verdicts of the report's target (the first target's where the report names none)."""
        named = [value for name, value in report.user_properties if name == TARGET_PROPERTY]
        return self.targets.get(named[0] if named else "", next(iter(self.targets.values())))

    @pytest.hookimpl(tryfirst=True)  # before junitxml and the terminal reporter read the report
    def pytest_runtest_logreport(self, report):
        if _is_worker(self.config):
            return
        if report.failed and isinstance(report.longrepr, str) and "crashed while running" in report.longrepr:
            report.longrepr += _crash_note(self.config, report.nodeid, self.started)
        verdicts = self.of(report)
        verdicts.count(report)
        if NUMERIC not in report.keywords:
            return
        if report.skipped:
            verdicts.numeric_skipped += 1
            for name, value in report.user_properties:
                if name == CANNOT_RUN_PROPERTY:
                    backend_name, reason = value
                    verdicts.cannot_run.setdefault(backend_name, reason)
        elif report.when == "call" or report.failed:
            verdicts.numeric_ran += 1

    def no_numeric_verdict(self) -> str | None:
        """NOT GREEN for each target none of whose numeric properties ran, one line each; None if none."""
        if self.config.getoption("--rpa-allow-no-numeric"):
            return None
        lines = [
            f"rpa-harness: NOT GREEN: no numeric property ran against target {name} "
            f"({verdicts.numeric_skipped} selected, all skipped; reasons below). Pass --rpa-allow-no-numeric "
            "(or RPA_ALLOW_NO_NUMERIC=1) to accept a run that checks no numbers."
            for name, verdicts in self.targets.items()
            if not verdicts.numeric_ran and verdicts.numeric_skipped
        ]
        return "\n".join(lines) or None

    def cannot_run(self) -> list[dict]:
        """Each target's backends it could not run on, with the reason a numeric property gave."""
        return [
            {"target": name, "backend": backend_name, "reason": reason}
            for name, verdicts in self.targets.items()
            for backend_name, reason in verdicts.cannot_run.items()
        ]

    def pytest_sessionfinish(self, session, exitstatus):
        if os.environ.get(runlog.ENV):  # every process: its compilations and cache use
            runlog.record_event("compilations", **device.compilation_stats())
        if _is_worker(self.config):
            return
        verdict = self.no_numeric_verdict()
        if verdict and exitstatus == pytest.ExitCode.OK:
            session.exitstatus = NO_NUMERIC_EXIT
        if OWNER in self.config.stash:
            runlog.record_event("chip_owner", **self.chip_owner_summary())
        if os.environ.get(runlog.ENV):
            chips = [e for e in runlog.read_events(os.environ[runlog.ENV]) if e["kind"] == "device"]
            runlog.write_session(
                no_numeric=verdict,
                cannot_run=self.cannot_run(),
                header=run_headers(self.config, chips or None),
                targets={
                    name: {**verdicts.outcomes, "failed_tests": verdicts.failed_tests, "repros": str(folder)}
                    for (name, verdicts), folder in zip(
                        self.targets.items(), repro_folders(self.config), strict=True
                    )
                },
            )

    def chip_owner_summary(self) -> dict:
        """The chip owners' calls and the fraction of the run's wall time their chips spent in them: each
        chip's (``per_chip``), and all of them together (of as many times the wall time as there are chips)."""
        summary = self.config.stash[OWNER].summary()
        wall = time.time() - self.started

        def busy_fraction(busy_s: float, chips: int = 1) -> float:
            return busy_s / (wall * chips) if wall > 0 else 0.0

        per_chip = [{**chip, "busy_fraction": busy_fraction(chip["busy_s"])} for chip in summary["per_chip"]]
        return {
            **summary,
            "per_chip": per_chip,
            "wall_s": wall,
            "busy_fraction": busy_fraction(summary["busy_s"], len(per_chip)),
        }

    @pytest.hookimpl(tryfirst=True)
    def pytest_terminal_summary(self, terminalreporter):
        if OWNER in self.config.stash:
            for line in chip_owner_lines(self.chip_owner_summary()):
                terminalreporter.write_line(f"rpa-harness: {line}")
        verdict = self.no_numeric_verdict()
        if verdict:
            terminalreporter.write_line(verdict, red=True, bold=True)
        for each in self.cannot_run():
            terminalreporter.write_line(
                f"rpa-harness: target {each['target']} cannot run on {each['backend']}: {each['reason']}. "
                "Its numeric properties there were skipped; its validator properties ran.",
                yellow=True,
            )
        if _serves_several_targets(self.config) and any(
            any(v.outcomes.values()) for v in self.targets.values()
        ):
            for name, verdicts in self.targets.items():
                failed = bool(verdicts.outcomes["failed"])
                terminalreporter.write_line(
                    f"rpa-harness: {verdicts.line(name)}", red=failed, green=not failed
                )


def chip_owner_lines(owners: dict) -> list[str]:
    """``RunVerdicts.chip_owner_summary`` in words: the owners' calls and how busy their chips were, all of
    them together, then each chip where there are several; then what was compiled and where a call's time
    went (``device.owner.summary_lines``)."""

    def ended(exits: list[int]) -> str:
        return f"; {len(exits)} ended early (exit {exits})" if exits else ""

    chips = owners["per_chip"]
    wall = (
        f"{owners['wall_s']:.1f} s" if len(chips) == 1 else f"{len(chips)} chips x {owners['wall_s']:.1f} s"
    )
    on_chips = f" on {len(chips)} chips" if len(chips) > 1 else ""
    lines = [
        f"chip owner: {owners['calls']} kernel calls, busy {owners['busy_s']:.1f} s of {wall} "
        f"({owners['busy_fraction']:.0%}); {owners['owners']} owner process(es){on_chips}{ended(owners['exits'])}"
    ]
    if len(chips) > 1:
        lines += [
            f"chip owner on chip {chip['chip']}: {chip['calls']} kernel calls, busy {chip['busy_s']:.1f} s of "
            f"{owners['wall_s']:.1f} s ({chip['busy_fraction']:.0%}); {chip['owners']} owner "
            f"process(es){ended(chip['exits'])}"
            for chip in chips
        ]
    return lines + [f"chip owner: {line}" for line in device.owner.summary_lines(owners)]


def run_headers(config, chips_seen: list[dict] | None = None) -> list[str]:
    """The header of each target the run serves (``run_header``), one after the other."""
    return [line for run in every_settings(config) for line in run_header(config, chips_seen, run)]


def run_header(config, chips_seen: list[dict] | None = None, run: RunSettings | None = None) -> list[str]:
    """What a run is testing, as its first lines say it: the target and its version, the backends, the
    precision contract, the rule table, the declared known issues, the buckets, and jax's version.

    On the tpu backend the chip is named as a process that opened it saw it: ``chips_seen`` (the run log's
    device events) or, in a process that runs the kernels itself, its own view; the xdist controller
    never opens the chip, and before its worker names it the header says so."""
    import jax

    from rpa_harness import __version__

    run = run or settings_of(config)
    target = run.target
    version = f" ({target.version})" if target.version else ""
    backends_line = ", ".join(backend.label for backend in run.backends)
    compat = "on" if run.interpreter_compat else "off"
    rules = (
        f"its own ({len(target.rules)} rules)"
        if target.own_rules
        else f"the specification's ({len(target.rules)} rules, stricter ones "
        f"{'on' if target.capabilities.strict_validation else 'off'})"
    )
    issues = ", ".join(issue.name for issue in target.known_issues) or "none"
    emulated = ", ".join(run.emulated_generations) or f"{generations.NONE} (a CPU device)"
    chip_line = f"  TPU generations emulated: {emulated}"
    if _on_a_tpu(config):
        if chips_seen is None and not _is_controller(config):
            tpus = device.tpus()
            chips_seen = [{"device_kind": tpus.kind, "count": tpus.count}]
        chips_seen = config.stash.get(OWNER_CHIPS, None) if chips_seen is None else chips_seen
        kinds = sorted({seen["device_kind"] for seen in chips_seen or ()})
        chip_line = (
            f"  TPU: {', '.join(kinds)}, real"
            if kinds
            else "  TPU: a real chip, named in the summary by the worker that opens it"
        )
        if WORKERS_ASKED in config.stash:
            chip_line += f"; 1 worker (-n {config.stash[WORKERS_ASKED]} asked: one process holds the chips)"
    if OWNER in config.stash:
        chips = len(config.stash[OWNER].supervisors)
        owners = (
            "one chip owner process makes"
            if chips == 1
            else f"{chips} chip owner processes, one a chip, make"
        )
        chip_line += f"; {owners} the kernel calls of {len(config.option.tx)} workers"
    buckets = run.buckets or target.capabilities.buckets
    chip_products = (
        f", + {BF16_MATMUL} on a TPU generation (float32 products at DEFAULT precision)"
        if target.product_precision == targets.DEFAULT_PRODUCTS
        else ""
    )
    if any(backend.name == device.TPU for backend in run.backends):
        chip_products += f", + {TPU_TRANSCENDENTALS} on a chip (its float32 exp, tanh and division)"
    return [
        f"rpa-harness {__version__}: target {target.name}{version}",
        f"  backends: {backends_line} (interpreter compat {compat}); jax {jax.__version__}",
        chip_line,
        f"  precision contract: {', '.join(target.precision)}{chip_products}",
        f"  validation rules: {rules}",
        f"  known issues declared: {issues}",
        f"  buckets: {', '.join(buckets)}",
    ]


def pytest_report_header(config):
    if _active(config) and SETTINGS in config.stash and not _is_worker(config):
        return run_headers(config)
    return None


def _crash_note(config, nodeid: str, started: float) -> str:
    """Names what a crashed worker left for this test: the hang or halt repro its last call wrote, else the
    example it had in flight, which on the tpu backend is the suspect of a crash of the device (a libtpu
    abort ends the process inside the call). The example in flight goes into the run log's summary too."""
    directory = Path(config.getoption("--rpa-repro-dir"))
    in_flight = None
    # A run of several targets keeps each one's repros in a folder of its own there (``repro_folders``).
    for path in sorted([*directory.glob("*.json"), *directory.glob("*/*.json")]):
        if path.stat().st_mtime < started:  # left by an earlier run
            continue
        try:
            written = repro.read(path)
        except repro.ReproError:
            continue
        if written.test != nodeid:
            continue
        if written.hang:
            return (
                f"\nHANG: a kernel call did not return within {written.hang['seconds']:g} s (RPA_CALL_TIMEOUT)"
                f"\n  repro: {path}\n  replay: rpa-harness replay {path}"
            )
        if written.halt:
            return (
                f"\nDEVICE HALTED: a kernel call raised {written.halt['error']}"
                f"\n  failure kind: {DEVICE_HALTED}\n{preceded_by_line(written)}  repro: {path}"
                f"\n  replay: rpa-harness replay {path}"
            )
        if written.in_flight:
            in_flight = (path, written.backend)
    elsewhere = (
        "no hang or halt repro names this test: the worker ended for another reason (see its stderr above)"
    )
    if in_flight is None:
        return f"\n({elsewhere})"
    path, backend = in_flight
    on_the_chip = backend == device.TPU
    runlog.record_event("crash", test=nodeid, in_flight=str(path), device=on_the_chip)
    cause = (
        "the worker died during a kernel call on the TPU (a crash of the device, e.g. a libtpu abort): "
        "the example in flight is the suspect"
        if on_the_chip
        else elsewhere
    )
    return f"\n{cause}\n  example in flight: {path}\n  replay: rpa-harness replay {path}"
