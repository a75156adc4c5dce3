"""pytest options, Hypothesis profiles and the fixtures every property uses.

Options (each also read from an environment variable):
  --rpa-target=MODULE           RPA_TARGET          the kernel module under test (default: kernel)
  --rpa-backend=NAME            RPA_BACKEND         interpret | fast-interpret | tpu | auto (default: auto)
  --rpa-repro-dir=DIR           RPA_REPRO_DIR       where failing examples are written (default: rpa-repros)
  --rpa-interpreter-compat=on|off                   patch the TPU interpreter for ref reshape/bitcast (default: on)
  --rpa-known-issues=auto|none|NAME[,NAME...]
                                RPA_KNOWN_ISSUES    known issues whose cases are not drawn (default: auto, the
                                                    target's declaration; see harness/known_issues.py)
Profiles (--hypothesis-profile or HYPOTHESIS_PROFILE): dev (default), ci, nightly, repro;
RPA_MAX_EXAMPLES resizes the chosen profile's base example count.
"""

import dataclasses
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from harness import backends, known_issues, repro, targets

DATABASE_DIR = os.environ.get("RPA_HYPOTHESIS_DB", ".hypothesis/examples")
_common = dict(
    deadline=None,  # the first call of each shape compiles
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=10, **_common)
settings.register_profile(
    "ci",
    max_examples=40,
    derandomize=True,  # also means database=None: every CI run sees the same examples
    phases=[
        Phase.explicit,
        Phase.generate,
        Phase.target,
        Phase.shrink,
    ],  # no `explain`: it re-runs the kernel
    **_common,
)
settings.register_profile(
    "nightly",
    max_examples=400,  # per round; ci/nightly.sh repeats rounds until its time budget is spent
    database=DirectoryBasedExampleDatabase(DATABASE_DIR),
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    **_common,
)
settings.register_profile(
    "repro",
    database=DirectoryBasedExampleDatabase(DATABASE_DIR),
    phases=[Phase.explicit, Phase.reuse],  # replay the saved failures, generate nothing
    **_common,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_addoption(parser):
    group = parser.getgroup("rpa-harness")
    group.addoption(
        "--rpa-target",
        default=os.environ.get("RPA_TARGET", targets.DEFAULT_TARGET),
        help="module with ragged_paged_attention and dynamic_validate_inputs (default: kernel)",
    )
    group.addoption(
        "--rpa-backend",
        default=os.environ.get("RPA_BACKEND", backends.AUTO),
        choices=(*backends.BACKENDS, backends.AUTO),
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
        help="patch the TPU interpreter so kernels that reshape or bitcast refs run (default: on)",
    )
    group.addoption(
        known_issues.OPTION,
        default=os.environ.get("RPA_KNOWN_ISSUES", known_issues.AUTO),
        help="auto (the target's RPA_HARNESS_KNOWN_ISSUES), none, or NAME[,NAME...]: known issues whose "
        "cases are not drawn and whose repros must still fail",
    )


@pytest.hookimpl(trylast=True)  # after Hypothesis's plugin has loaded --hypothesis-profile
def pytest_configure(config):
    if os.environ.get("RPA_MAX_EXAMPLES"):  # resize the chosen profile (benchmarks, long local runs)
        settings.register_profile(
            "sized", parent=settings.default, max_examples=int(os.environ["RPA_MAX_EXAMPLES"])
        )
        settings.load_profile("sized")
    try:
        config.rpa_target = targets.load(config.getoption("--rpa-target"))
    except targets.TargetError as error:
        raise pytest.UsageError(str(error)) from None
    try:
        declared = known_issues.parse_option(
            config.getoption(known_issues.OPTION), config.rpa_target.known_issues
        )
    except known_issues.KnownIssueError as error:
        raise pytest.UsageError(str(error)) from None
    config.rpa_target = dataclasses.replace(config.rpa_target, known_issues=declared)
    compat = config.getoption("--rpa-interpreter-compat") == "on"
    config.rpa_backends = [
        backends.Backend(name, compat) for name in backends.resolve(config.getoption("--rpa-backend"))
    ]
    config.rpa_cannot_run = {}  # backend name -> reason the target cannot run there


VOLUME = (backends.FAST_INTERPRET, backends.TPU)
CHECKING = (backends.INTERPRET, backends.TPU)


def pytest_generate_tests(metafunc):
    """``volume_backend``: where many examples run; ``checking_backend``: where memory safety is checked."""
    for fixture, kinds in (("volume_backend", VOLUME), ("checking_backend", CHECKING)):
        if fixture in metafunc.fixturenames:
            chosen = [b for b in metafunc.config.rpa_backends if b.name in kinds]
            metafunc.parametrize(fixture, chosen, ids=[b.name for b in chosen], scope="session")


@pytest.fixture(scope="session")
def target(pytestconfig):
    return pytestconfig.rpa_target


@pytest.fixture(scope="session")
def backend(pytestconfig):
    """The backend for properties that need one kernel run per example and no volume (the first chosen)."""
    return pytestconfig.rpa_backends[0]


def _require_runnable(config, target, backend):
    if backend.skip_reason:
        pytest.skip(backend.skip_reason)
    if backend.name not in config.rpa_cannot_run:
        try:
            targets.smallest_output(target, backend)
            config.rpa_cannot_run[backend.name] = None
        except Exception as error:  # any failure on the tiniest case means the target cannot run here
            config.rpa_cannot_run[backend.name] = targets.first_line_of_error(error)
    reason = config.rpa_cannot_run[backend.name]
    if reason:
        pytest.skip(f"target {target.name} cannot run on {backend.name}: {reason}")
    return backend


@pytest.fixture(scope="session")
def runnable(pytestconfig, target):
    """Returns a function that skips (once-reported) when the target cannot run on a backend."""
    return lambda backend: _require_runnable(pytestconfig, target, backend)


@pytest.fixture(scope="session")
def repro_dir(pytestconfig):
    return Path(pytestconfig.getoption("--rpa-repro-dir"))


def pytest_terminal_summary(terminalreporter, config):
    for backend_name, reason in getattr(config, "rpa_cannot_run", {}).items():
        if reason:
            terminalreporter.write_line(
                f"rpa-harness: target {config.rpa_target.name} cannot run in {backend_name} mode: {reason}. "
                "Its numeric properties were skipped; its validator properties ran.",
                yellow=True,
            )
