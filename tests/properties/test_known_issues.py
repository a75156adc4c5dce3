"""Each known issue the target declares still reproduces: an expected failure until it is fixed.

The strategies do not draw a declared issue's cases, so this property is what notices a fix: it replays
the issue's repro pair against the target on every chosen backend, under the TPU generation the repro
records. Still failing with the issue's symptom is an expected failure (xfail); passing fails the run, as a
strict xfail does, asking to remove the entry; failing in another way (e.g. a crash instead of a wrong
value, or a failure of a kind its ``fails_as`` does not declare) fails the run too, since that is news. On a
backend that cannot see the issue (``KnownIssue.backends``: a read past a buffer whose value is unused
shows only where bounds are checked) the repro must pass. A repro
of a long or production case replays where its property runs, on the volume backends only: the checking
interpreter takes minutes per call at that scale (docs/production-and-long-shapes.md). A repro of the
compile property (a configuration the chip's compiler refuses) is compiled again, once per run, on this
host's TPU compiler for the generation it records; without one it is not run. On a real chip an issue is
replayed with a repro recorded for that chip's generation, or for none (``KnownIssue.repro_on_chip``): a
repro recorded for another generation shows that generation's code, so it is not replayed there, and an
issue outside the chip's generation does not apply. A repro stopped on a chip by what a declared issue
predicts for its case (a configuration this chip's compiler refuses, a tiling it rejects) is masked by
that issue: the chip cannot show the replayed one with this repro.

Under ``--rpa-predict-chip`` an interpreter emulating a generation G predicts what a chip of G says (what
``rpa-harness chip verdicts`` compares with a chip's table): the repro ``repro_on_chip(G)`` picks, replayed
under G's emulation; a numeric repro compiled first for G on this host's TPU compiler, as the chip compiles
before it calls, so that a refusal another declared finding predicts masks it as on the chip; a halt's
repro, after the examples its process ran before it, on the checking interpreter emulating G, whose exit
check (``WouldHaltATpu``) is what halts a chip; a hang's that reproduces, a hang.
"""

import pytest

from rpa_harness import device, generations, property_names, runlog
from rpa_harness import repro as repro_files
from rpa_harness.checks import CannotRun, check_compiles, declared_unrunnable, recheck
from rpa_harness.failures import PropertyFailure, RaisedOnValidInput
from rpa_harness.known_issues import OPTION, PREDICT_CHIP_OPTION, on_generation
from rpa_harness.plugin import VOLUME, parametrize_per_target, settings_of
from rpa_harness.run_settings import for_repro


def _declared_issues(run) -> list:
    return [pytest.param(issue, id=issue.name) for issue in run.target.known_issues]


def pytest_generate_tests(metafunc):
    if "known_issue" in metafunc.fixturenames:
        parametrize_per_target(metafunc, "known_issue", _declared_issues)


# The property kinds whose repro arrays are the kernel call's: a chip compiles that call before it runs it.
CALLS_THE_KERNEL = (property_names.DIFFERENTIAL, property_names.DETERMINISM)


def chip_of(backend, pytestconfig) -> str | None:
    """The TPU generation whose chip this replay is, or stands for: a real chip's own, or under
    ``--rpa-predict-chip`` the one the interpreter emulates; None for an interpreter that stands for none."""
    if backend.name == device.TPU:
        return backend.generation_seen
    if pytestconfig.getoption(PREDICT_CHIP_OPTION) and backend.generation != generations.NONE:
        return backend.generation
    return None


def chip_refusal_masking(failure, known_issue, repro, backend, chip, target) -> str | None:
    """The declared issue whose predicate matches ``repro``'s case and whose symptom its failure shows,
    where the repro of another issue fails on a chip (``chip``: a real one, or the one an interpreter
    predicts) without that issue's own symptom (the chip's compiler refuses the configuration, or the
    kernel rejects a tiling the chip has): the chip cannot show ``known_issue`` with this repro, which is
    not news. The predicates see the backend's emulated generation, as the kernel traced for it does."""
    if chip is None or repro.case is None or known_issue.shows(str(failure)):
        return None
    for issue in on_generation(target.known_issues, backend.generation):
        if issue.name != known_issue.name and issue.matches(repro.case) and issue.shows(str(failure)):
            return issue.name
    return None


def compiled_first(target, chip: str, repro, replay) -> None:
    """``replay()`` after the repro's kernel call is compiled ahead of time for ``chip``, as a chip compiles
    it before the call: a refusal of the compiler or of the kernel's tiling is the failure. Where the kernel
    raised while traced for the chip, the replay's failure is, where the interpreter's trace raises too (in
    the property's own words), else what it raised. Without a compile where this host has no TPU compiler,
    the target declares it runs on no chip, or its kernel reads its inputs' values while traced."""
    compiler = device.Backend(device.TPU_COMPILER, True, chip)
    if not compiler.skip_reason and not declared_unrunnable(target, compiler):
        try:
            check_compiles(target, compiler, repro.arrays, repro.options)
        except CannotRun:
            pass
        except RaisedOnValidInput:
            replay()
            raise
    replay()


def test_known_issue_still_reproduces(target, replay_backend, known_issue, pytestconfig):
    repro_path = known_issue.repro
    chip = chip_of(replay_backend, pytestconfig)
    predicting = chip is not None and replay_backend.name != device.TPU
    if chip is not None:
        repro_path, why_not = known_issue.repro_on_chip(chip)
        if repro_path is None:
            outcome = why_not.split(" (", 1)[0]
            runlog.record_event(
                "known-issue-replay", issue=known_issue.name, backend=replay_backend.label, outcome=outcome
            )
            pytest.skip(f"{known_issue.name} on a TPU {chip}: {why_not}")
    repro = repro_files.read(repro_path)
    if repro.kind == property_names.COMPILATION:
        if replay_backend != settings_of(pytestconfig, target).backends[0]:
            pytest.skip(
                f"{known_issue.name}: a compile repro is compiled once a run, on the first backend's turn"
            )
        replay_backend = device.Backend(
            device.TPU_COMPILER, True, chip if predicting else repro.tpu_generation
        )
        if replay_backend.skip_reason:
            runlog.record_event(
                "known-issue-replay", issue=known_issue.name, backend=replay_backend.label, outcome="not run"
            )
            pytest.skip(f"{known_issue.name}: its repro is compiled for a TPU: {replay_backend.skip_reason}")
    if (repro.halt or repro.hang) and replay_backend.name == device.TPU:
        runlog.record_event(
            "known-issue-replay", issue=known_issue.name, backend=replay_backend.label, outcome="not run"
        )
        ends = "halts the chip" if repro.halt else "hangs"
        pytest.skip(
            f"{known_issue.name}: its repro {ends}, which would end this process: replay it in one of its "
            f"own, `rpa-harness replay {repro_path} --backend tpu`"
        )
    # Rebuilt as `rpa-harness replay` rebuilds it (the contract it failed under, the chip it was recorded
    # for: an issue of one generation's code does not show on another), on this run's backend; predicting a
    # chip, under its generation, a halt on the interpreter that checks what a chip halts on.
    halts_on_the_interpreter = predicting and bool(repro.halt)
    not_on_the_checker = (
        declared_unrunnable(target, device.Backend(device.INTERPRET)) if halts_on_the_interpreter else None
    )
    if not_on_the_checker:
        runlog.record_event(
            "known-issue-replay", issue=known_issue.name, backend=replay_backend.label, outcome="not run"
        )
        pytest.skip(
            f"{known_issue.name}: its halt is predicted on the checking interpreter, but {target.name} "
            f"{not_on_the_checker}"
        )
    run = for_repro(
        repro,
        target=target.name,
        backend=device.INTERPRET if halts_on_the_interpreter else replay_backend.name,
        tpu_generation=chip if predicting else None,
        interpreter_compat=replay_backend.interpreter_compat,
    )
    target, replay_backend = run.target, run.backends[0]
    run_first = []  # a halt's predecessors, each with its settings: a call can leave the fault the next meets
    if halts_on_the_interpreter:
        predecessors = repro_files.predecessors(repro_path, repro)
        run_first = [
            (example, for_repro(example, target=target.name, backend=device.INTERPRET, tpu_generation=chip))
            for example in predecessors
        ]
    where = f"{known_issue.name} in {target.name} on {replay_backend.label}"

    def record(outcome: str) -> None:  # for the summary of ``rpa-harness run``
        runlog.record_event(
            "known-issue-replay", issue=known_issue.name, backend=replay_backend.label, outcome=outcome
        )

    bucket = property_names.large_bucket(repro.property)
    if bucket is not None and replay_backend.name not in VOLUME:
        record("not run (a large case)")
        pytest.skip(
            f"{where}: its repro is a {bucket}-bucket case, which runs on {', '.join(VOLUME)} only, as the "
            f"{bucket} bucket's properties do"
        )
    visible = known_issue.visible_on(replay_backend.name)

    def replay() -> None:
        for example, settings in run_first:
            recheck(settings.target, settings.backends[0], example)
        if known_issue.replay is not None:  # a target's own property (e.g. v3's attention and cache)
            known_issue.replay(known_issue, target, replay_backend, repro)
        else:
            recheck(target, replay_backend, repro)

    try:
        if predicting and repro.kind in CALLS_THE_KERNEL:
            compiled_first(target, chip, repro, replay)
        else:
            replay()
    except AssertionError as failure:
        report = str(failure)
        if not visible:
            record("fails where it cannot show")
            pytest.fail(
                f"{where}: its repro {repro_path} fails on a backend that cannot see the issue (it "
                f"shows on {', '.join(known_issue.backends)} only), so this is another failure:\n{report}"
            )
        masking = chip_refusal_masking(failure, known_issue, repro, replay_backend, chip, target)
        if masking is not None:
            record(f"masked by {masking}")
            pytest.skip(
                f"{where}: this chip stops its repro {repro_path} the way the declared issue {masking} "
                f"predicts for its case, so it cannot show this one; the finding stands where it was found:\n"
                f"{report}"
            )
        if not known_issue.shows(report):
            record("fails differently")
            pytest.fail(
                f"{where}: its repro {repro_path} fails, but not with the issue's symptom "
                f"(/{known_issue.symptom}/):\n{report}"
            )
        if isinstance(failure, PropertyFailure) and known_issue.kind_of(failure) is None:
            record("fails as another kind")
            declared = ", ".join(kind.kind for kind in known_issue.fails_as) or "none"
            pytest.fail(
                f"{where}: its repro {repro_path} fails as {failure.kind}, a kind its fails_as does not declare "
                f"({declared}), so a failure like it is not offered the issue: add that kind's class of "
                f"rpa_harness.failures to its fails_as:\n{report}"
            )
        if predicting and (repro.halt or repro.hang):  # what a chip does on the failure the interpreter sees
            record(f"reproduces: {'halts the chip' if repro.halt else 'hangs'}")
        else:
            record("reproduces")
        pytest.xfail(f"{where} still reproduces: {report.splitlines()[0][:200]}")
    if not visible:  # its cases are drawn here too; the repro passing is what this backend can check
        record("passes (not visible here)")
        return
    record("FIXED")
    pytest.fail(
        f"{known_issue.name} is fixed in {target.name} (its repro {repro_path} passes on "
        f"{replay_backend.label}): remove it from the known issues (the module's RPA_HARNESS_KNOWN_ISSUES, "
        f"or {OPTION})"
    )
