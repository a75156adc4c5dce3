"""Targets are one place each: the loader reads a profile from a module's declarations, the core holds
nothing of any one target, and a run says what it tests."""

import ast
import dataclasses
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from rpa_harness import checks, device, failures, known_issues, property_names, recording, targets
from rpa_harness.property_names import PropertyName
from rpa_harness.strategies import violations
from rpa_harness.strategies.capabilities import Capabilities
from rpa_harness.strategies.case import Case
from rpa_harness.targets import upstream as upstream_profile
from tests.cases import sized_case
from tests.processes import run_python

ROOT = Path(__file__).resolve().parents[2]
# The core: what every target shares. A target's own text belongs in its module under rpa_harness/targets/.
CORE = [
    "spec",
    "strategies",
    "reference",
    "rpa_harness/checks.py",
    "rpa_harness/plugin.py",
    "rpa_harness/known_issues.py",
]
TARGET_SPECIFIC = re.compile(r"\bv3\b|v3'|tpu.inference", re.IGNORECASE)


def test_the_core_names_no_target():
    found = []
    for entry in CORE:
        paths = [ROOT / entry] if entry.endswith(".py") else sorted((ROOT / entry).rglob("*.py"))
        for path in paths:
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if TARGET_SPECIFIC.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == [], "\n".join(found)


def _module(name="user_target", **attributes):
    module = types.ModuleType(name)
    module.ragged_paged_attention = lambda *args, **kwargs: None
    module.dynamic_validate_inputs = lambda *args, **kwargs: None
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


def test_a_module_without_declarations_is_held_to_the_whole_space(monkeypatch):
    monkeypatch.setitem(sys.modules, "user_target", _module())
    target = targets.load("user_target")
    assert target.capabilities == Capabilities()
    assert target.rules is violations.RULES and not target.own_rules
    assert target.known_issues == ()
    # A kernel of its own still hears about every kind of discrepancy the shipped catalogues know.
    assert target.catalogue == targets.shipped_catalogue()
    assert set(upstream_profile.RPA_HARNESS_CATALOGUE) <= set(target.catalogue)


def _catalogued(target, *names):
    """The named entries of ``target``'s catalogue, or a skip where a shipped catalogue did not import."""
    by_name = {issue.name: issue for issue in target.catalogue}
    if not set(names) <= set(by_name):
        pytest.skip(f"catalogues without {sorted(set(names) - set(by_name))}")
    return [by_name[name] for name in names]


def test_a_failure_is_offered_the_findings_of_its_kind_its_case_matches(monkeypatch):
    """A decode with no query rows before a live sequence, failing as v3's hang does on the checking
    interpreter (a deadlock, raised): a kernel of its own hears of v3's finding, with v3 named."""
    monkeypatch.setitem(sys.modules, "user_target", _module())
    target = targets.load("user_target")
    _catalogued(target, "q-len-zero-before-a-live-sequence-hangs")
    case = Case(
        max_num_batched_tokens=8, max_num_seqs=2, pages_per_seq=2, total_num_pages=4, page_size=8,
        num_q_heads=2, num_kv_heads=1, head_dim=128, q_lens=(0, 2), kv_lens=(3, 5),
    )  # fmt: skip
    deadlock = failures.RaisedOnValidInput("user_target on interpret raised on valid inputs: Deadlock")
    offered = known_issues.describe_matches(case, deadlock, target.catalogue, target.catalogue_kernels)
    assert (
        f"q-len-zero-before-a-live-sequence-hangs (kernel {targets.V3_TARGET}; symptom: raised on valid input)"
        in offered.splitlines()[-1]
    ), offered


def test_a_float32_precision_failure_is_not_offered_mla_refusals(tmp_path):
    """A fork-like kernel that promises float32 and multiplies at DEFAULT precision, over the bound on an
    emulated v5e with its block sizes left to the kernel: MLA's default-block findings match the case's
    block sizes, but they are MLA kernels' refusals to run, so the failure names none of them."""
    target = targets.load("tests.broken.default_precision_products")
    refusals = _catalogued(target, "mla-v1-default-block-sizes-raise", "mla-v2-default-block-sizes-raise")
    v5e = device.Backend(device.FAST_INTERPRET, generation="v5e")
    case = sized_case((1, 3), (1, 9), head_dim=64, num_q_heads=2, num_kv_heads=1, page_size=8)
    assert case.num_kv_pages_per_block is None and case.num_queries_per_block is None
    assert all(issue.matches(case) for issue in known_issues.on_generation(tuple(refusals), "v5e"))
    arrays = case.arrays()
    with pytest.raises(failures.OverTheBound) as failure:
        with recording.recorded(
            tmp_path,
            PropertyName(property_names.DIFFERENTIAL),
            target,
            v5e,
            arrays,
            case.options(),
            case=case,
        ):
            checks.check_differential(target, v5e, arrays, case.options())
    report = str(failure.value)
    assert "diagnosis: consistent with bf16-matmul" in report, report
    assert failures.PRODUCTS_ON_TPU_GENERATIONS.note() in report  # the release that multiplies as the chip
    assert "known issues this case matches: none (" in report and "fails as outputs over the bound" in report
    assert "mla-v1" not in report and "mla-v2" not in report, report


def test_a_halt_on_an_empty_batch_is_offered_the_halting_finding_not_an_mla_trace_failure(monkeypatch):
    """An upstream-API kernel of its own that would halt a TPU on an empty batch: upstream's unwaited
    prefetch fits it; MLA v1's query-block finding matches the case's block sizes but is an MLA kernel's
    trace failure, offered only for a latent case that raises."""
    monkeypatch.setitem(sys.modules, "user_target", _module())
    target = targets.load("user_target")
    halting, tracing = _catalogued(
        target,
        "unwaited-kv-prefetch-halts-the-chip",
        "mla-v1-query-block-not-dividing-q-heads-fails-to-trace",
    )
    empty = Case(
        max_num_batched_tokens=8, max_num_seqs=2, pages_per_seq=2, total_num_pages=4, page_size=8,
        num_q_heads=2, num_kv_heads=1, head_dim=128, q_lens=(), kv_lens=(),
        num_kv_pages_per_block=1, num_queries_per_block=8,
    )  # fmt: skip
    assert halting.matches(empty) and tracing.matches(empty)
    would_halt = failures.located(failures.WouldHaltATpu, [])("user_target on interpret: WOULD HALT A TPU")
    offered = known_issues.describe_matches(empty, would_halt, target.catalogue, target.catalogue_kernels)
    lines = offered.strip().splitlines()
    assert lines[1:] == [
        f"    {halting.name} (kernel {targets.UPSTREAM_TARGET}; symptom: {failures.WouldHaltATpu.kind})"
    ], offered
    latent = dataclasses.replace(empty, head_dim=576, value_head_dim=512)
    raised = failures.RaisedOnValidInput("raised on valid inputs: AssertionError")
    assert f"{tracing.name} (kernel {targets.MLA_V1_TARGET}; symptom: raised on valid input)" in (
        known_issues.describe_matches(latent, raised, target.catalogue, target.catalogue_kernels)
    )
    assert tracing.name not in known_issues.describe_matches(
        empty, raised, target.catalogue, target.catalogue_kernels
    )


def test_a_known_issue_declares_failure_kinds():
    with pytest.raises(known_issues.KnownIssueError, match=r"fails_as=\('outputs over the bound',\) holds"):
        dataclasses.replace(upstream_profile.RPA_HARNESS_CATALOGUE[0], fails_as=("outputs over the bound",))
    one_kind = dataclasses.replace(upstream_profile.RPA_HARNESS_CATALOGUE[0], fails_as=failures.OverTheBound)
    assert one_kind.fails_as == (failures.OverTheBound,)
    located = failures.located(failures.OverTheBound, [1 << 16])("past 2^15 keys")
    assert one_kind.kind_of(located) is failures.OverTheBound
    assert one_kind.kind_of(failures.NonFiniteOutput("NaN")) is None


def test_a_declared_rule_table_is_the_targets(monkeypatch):
    rule = violations.Rule("dynamic", violations.break_num_seqs_over_max, lambda num_seqs, max_num_seqs: "x")
    monkeypatch.setitem(sys.modules, "user_target", _module(RPA_HARNESS_RULES={"over": rule}))
    target = targets.load("user_target")
    assert target.own_rules and target.rules == {"over": rule}


@pytest.mark.parametrize(
    "declaration, complaint",
    [
        ({"RPA_HARNESS_RULES": {"over": "not a rule"}}, "are not rpa_harness.strategies.violations.Rule"),
        ({"RPA_HARNESS_RULES": {}}, "a rule table is a non-empty dict"),
        ({"RPA_HARNESS_CAPABILITIES": {"head_dims": (96,)}}, "RPA_HARNESS_CAPABILITIES"),
        ({"RPA_HARNESS_KNOWN_ISSUES": ("no-such-issue",)}, "unknown known issue 'no-such-issue'"),
        ({"RPA_HARNESS_UPDATES_CACHE": "yes"}, "RPA_HARNESS_UPDATES_CACHE is 'yes'; declare True"),
        ({"RPA_HARNESS_BASELINE": 3}, "RPA_HARNESS_BASELINE is 3; declare the module name"),
        (
            {"dynamic_validate_inputs": None},
            "it has no dynamic_validate_inputs, but the specification's rule table",
        ),
    ],
)
def test_a_malformed_declaration_is_one_clear_error(monkeypatch, declaration, complaint):
    monkeypatch.setitem(sys.modules, "user_target", _module(**declaration))
    with pytest.raises(targets.TargetError) as error:
        targets.load("user_target")
    assert complaint in str(error.value) and "--rpa-target=user_target" in str(error.value)


def test_a_kernel_without_a_dynamic_validator_declares_static_rules(monkeypatch):
    static = violations.Rule("static", violations.break_soft_cap, lambda value: f"soft_cap {value}")
    dynamic = violations.Rule(
        "dynamic", violations.break_num_seqs_over_max, lambda num_seqs, max_num_seqs: "x"
    )
    module = _module(RPA_HARNESS_RULES={"cap": static})
    del module.dynamic_validate_inputs
    monkeypatch.setitem(sys.modules, "user_target", module)
    assert not targets.load("user_target").has_validator
    module.RPA_HARNESS_RULES = {"cap": static, "over": dynamic}
    with pytest.raises(targets.TargetError, match=r"its RPA_HARNESS_RULES has 1 dynamic rules \(over\)"):
        targets.load("user_target")


def test_a_rule_breaks_one_stage():
    with pytest.raises(ValueError, match="stage='runtime'"):
        violations.Rule("runtime", violations.break_num_seqs_shape, str)


def test_shipped_profiles_and_versions():
    bundled = targets.load(targets.DEFAULT_TARGET)
    assert bundled.capabilities.strict_validation and bundled.rules is violations.RULES
    assert bundled.version.startswith("rpa-harness ")
    upstream = targets.load(targets.UPSTREAM_TARGET)
    assert upstream.capabilities.needs_block_sizes and upstream.version.startswith("jax ")
    assert upstream.known_issues == upstream_profile.RPA_HARNESS_CATALOGUE


def test_the_run_header_says_what_is_tested():
    """pytest's report header, as the run prints it before any test."""
    result = run_python(
        "-m", "pytest", "tests/properties/test_validation.py", "--collect-only", "-p", "no:cacheprovider",
        f"--rpa-target={targets.UPSTREAM_TARGET}", "--rpa-backend=fast-interpret", "--rpa-buckets=tiny",
        cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    header = result.stdout
    assert f"target {targets.UPSTREAM_TARGET} (jax " in header
    # upstream declares the generations it branches on: by default two are emulated
    assert "backends: fast-interpret-v5e, fast-interpret-v6e (interpreter compat on); jax " in header
    assert "TPU generations emulated: v5e, v6e\n" in header
    assert "precision contract: float32" in header
    assert "validation rules: the specification's (21 rules, stricter ones off)" in header
    assert "known issues declared: empty-sequence-shifts-kv-pages, one-kv-scale-with-mixed-dtypes" in header
    assert "buckets: tiny\n" in header


def test_a_version_comes_from_the_distribution_that_holds_the_module():
    """tpu-inference installs a top-level ``tests`` package; this checkout's ``tests/`` is not it."""
    assert targets.load("tests.flat_pages.target").version is None
    assert targets.load(targets.DEFAULT_TARGET).version.startswith("rpa-harness ")
    assert targets.load(targets.UPSTREAM_TARGET).version.startswith("jax ")


def test_every_package_of_the_harness_is_in_the_wheel():
    """A new target package under rpa_harness/targets/ needs its line in pyproject.toml's package list."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(("rpa_harness", *init.parent.relative_to(ROOT / "rpa_harness").parts))
        for init in (ROOT / "rpa_harness").rglob("__init__.py")
    }
    assert found - listed == set(), (
        f"packages under rpa_harness/ missing from pyproject.toml: {found - listed}"
    )


TARGETS = ROOT / "rpa_harness" / "targets"
# v3 and the forks that build on its own rules and findings; every other target builds on the family's floor.
V3_AND_ITS_FORKS = ("tpu_inference_v3", "tpu_inference_v3_hd64", "tpu_inference_rpa_v3_cp")


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or in a function, ``from package import module`` as
    ``package.module``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update({node.module, *(f"{node.module}.{alias.name}" for alias in node.names)})
    return names


def importers(paths, imported: Callable[[str], bool]) -> list[str]:
    """``file: module`` for each module a file of ``paths`` imports that ``imported`` selects."""
    return [
        f"{path.relative_to(ROOT)}: {name}"
        for path in paths
        for name in sorted(imported_modules(path))
        if imported(name)
    ]


def test_only_v3_and_its_forks_import_v3():
    """The tpu-inference targets build on their family's floor (``targets.tpu_inference``), v3 one target
    among them: outside v3's package and its forks' no module imports v3's."""
    others = [
        path
        for path in sorted(TARGETS.rglob("*.py"))
        if path.relative_to(TARGETS).parts[0].removesuffix(".py") not in V3_AND_ITS_FORKS
    ]
    v3 = "rpa_harness.targets.tpu_inference_v3"
    assert importers(others, lambda name: name == v3 or name.startswith(v3 + ".")) == []


def test_the_family_floor_imports_no_target():
    """The floor is beneath every tpu-inference target: it imports none of them."""
    floor = sorted((TARGETS / "tpu_inference").rglob("*.py"))
    assert importers(floor, lambda name: name.startswith("rpa_harness.targets.tpu_inference_")) == []


@pytest.mark.parametrize("shipped", targets.SHIPPED, ids=lambda shipped: shipped.name)
def test_each_shipped_target_loads_by_its_name_and_its_aliases(shipped):
    try:
        loaded = targets.load(shipped.name)
    except targets.TargetError as error:
        # Not installed, or a kernel that cannot run on this jax (stacked RPA on jax >= 0.12): its loader says.
        if "tpu-inference is not installed" not in str(error) and "does not trace on jax" not in str(error):
            raise
        pytest.skip(str(error))
    assert loaded.version and [targets.load(alias).name for alias in shipped.aliases] == [loaded.name] * len(
        shipped.aliases
    )


def test_a_target_and_a_known_issue_print_as_one_short_line():
    """Hypothesis prints a failing example's arguments, the target and a known issue among them: their whole
    profile (every issue's explanation) once made a failure hundreds of lines long."""
    target = targets.load(targets.UPSTREAM_TARGET)
    assert repr(target) == f"Target({targets.UPSTREAM_TARGET!r})"
    assert [repr(issue) for issue in target.known_issues[:1]] == [
        f"KnownIssue({target.known_issues[0].name!r})"
    ]


def test_an_exception_without_a_message_says_where_it_was_raised():
    def kernel_body():
        raise AssertionError  # a bare assert in a kernel (pytest rewrites this module's asserts)

    try:
        kernel_body()
    except AssertionError as error:
        said = targets.first_line_of_error(error)
    assert re.fullmatch(r"AssertionError \(raised at test_targets\.py:\d+ in kernel_body\)", said), said
    assert targets.first_line_of_error(ValueError("first\nsecond")) == "ValueError: second"


@pytest.mark.parametrize(
    "misspelt, nearest",
    [
        ("RPA_HARNESS_PROFIL", "RPA_HARNESS_PROPERTIES"),
        ("RPA_HARNESS_CAPABILITY", "RPA_HARNESS_CAPABILITIES"),
        ("RPA_HARNESS_KNOWN_ISSUE", "RPA_HARNESS_KNOWN_ISSUES"),
        ("RPA_HARNESS_PRECISON", "RPA_HARNESS_PRECISION"),
    ],
)
def test_a_misspelt_profile_attribute_fails_the_load_naming_the_nearest(monkeypatch, misspelt, nearest):
    monkeypatch.setitem(sys.modules, "user_target", _module(**{misspelt: ("bf16",)}))
    with pytest.raises(targets.TargetError) as error:
        targets.load("user_target")
    message = str(error.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith(f"--rpa-target=user_target: user_target defines {misspelt} = ('bf16',), ")
    assert f"did you mean {nearest}?" in message and "docs/targets.md" in message


def test_every_profile_attribute_is_documented_and_a_long_value_is_cut(monkeypatch):
    documented = set(re.findall(r"RPA_HARNESS_[A-Z_]+", (ROOT / "docs" / "targets.md").read_text()))
    assert set(targets.PROFILE_ATTRIBUTES) <= documented
    monkeypatch.setitem(sys.modules, "user_target", _module(RPA_HARNESS_PROFIL=tuple(range(100))))
    with pytest.raises(targets.TargetError, match=r"= \(0, 1, 2, .{40,50}\.\.\., which is not"):
        targets.load("user_target")


def test_a_misspelt_profile_attribute_on_the_command_line_is_one_usage_error(monkeypatch, capsys):
    from rpa_harness import cli

    monkeypatch.setitem(sys.modules, "user_target", _module(RPA_HARNESS_PROFIL=1))
    assert cli.main(["bench", "--target", "user_target"]) == cli.USAGE
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    assert "RPA_HARNESS_PROFIL = 1" in captured.err and "RPA_HARNESS_PROPERTIES" in captured.err
