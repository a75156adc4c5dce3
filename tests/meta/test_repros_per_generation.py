"""Every finding a shipped target declares has a repro that each chip it applies to replays.

A real chip replays a finding's repro only where it was recorded for that chip's generation, or for none
(``KnownIssue.repro_on_chip``): the kernel's and the compiler's code differ per generation, so a repro of
another generation says nothing there, and the chip reports the finding as recorded elsewhere, not replayed,
with no verdict. So each declared finding needs, for each chip generation it applies to (``generations``;
empty: every one), a repro in its folder recorded for that generation or for none; or a declaration narrowed,
with the reason in the kernel's code, to the generations that have it.

Reads the declarations and the repros' JSON only (no kernel call). A target's declaration is judged where
it loads (one whose kernel does not import here, tpu-inference absent or a jax it does not trace on, is
skipped with the reason; the tpu-inference family declares the findings of the installed release), and
every shipped catalogue as a whole, which needs no kernel.
"""

import pytest

from rpa_harness import generations, targets
from rpa_harness.known_issues import KnownIssue
from tests.cases import issue_with, repro_recorded_for

# The generations whose chips judge the catalogue (`rpa-harness chip verdicts --backend tpu`): v5e's, v6e's and 7x's.
CHIP_GENERATIONS = ("v5e", "v6e", "7x")


def how_to_record(issue: KnownIssue, generation: str) -> str:
    """The command that shows whether the finding's repro fails on ``generation`` too (on the backend it was
    recorded on, or that generation's compiler for a compile repro), and what to do with its answer."""
    return (
        f"`rpa-harness replay {issue.repro} --tpu-generation {generation}` exits 1 while its case shows the "
        f"finding there: write that example beside it as recorded for {generation} (its property's label and "
        f"`tpu_generation` naming {generation}, rpa_harness.repro.write); where it exits 0, narrow the "
        "finding's `generations=` with the reason in the kernel's or the compiler's code"
    )


def unreplayed(issues) -> list[str]:
    """One line per (finding, chip generation it applies to) that no repro of its folder serves."""
    return [
        f"{issue.name} on {generation} (declared for {', '.join(issue.generations) or 'every generation'}): "
        f"{why.split(' (', 1)[0]}; {how_to_record(issue, generation)}"
        for issue in issues
        for generation in CHIP_GENERATIONS
        if issue.applies_to(generation)
        for path, why in [issue.repro_on_chip(generation)]
        if path is None
    ]


@pytest.mark.parametrize("target_name", [shipped.name for shipped in targets.SHIPPED])
def test_each_declared_finding_has_a_repro_for_each_chip_it_applies_to(target_name):
    try:
        target = targets.loaded(target_name)
    except targets.TargetError as error:
        pytest.skip(f"{target_name} does not load here: {str(error).splitlines()[0]}")
    missing = unreplayed(target.known_issues)
    assert not missing, (
        f"{target_name}: {len(missing)} declared finding(s) without a repro a chip of a generation they apply "
        "to replays:\n  " + "\n  ".join(missing)
    )


def test_each_catalogued_finding_has_a_repro_for_each_chip_it_applies_to():
    """Every shipped catalogue whole, whatever is installed: the findings of other tpu-inference releases
    (declared where one of them is installed) and of targets that load on another jax only."""
    missing = unreplayed(targets.shipped_catalogue())
    assert not missing, (
        f"{len(missing)} catalogued finding(s) without a repro a chip of a generation they apply to replays:\n  "
        + "\n  ".join(missing)
    )


def test_a_finding_recorded_for_one_generation_lacks_the_others_it_applies_to(tmp_path):
    for_v6e = repro_recorded_for(tmp_path / "finding", "r", "v6e")
    lines = unreplayed([issue_with(for_v6e)])
    assert [line.split(" (", 1)[0] for line in lines] == ["an-issue on v5e", "an-issue on 7x"]
    assert f"rpa-harness replay {for_v6e} --tpu-generation v5e" in lines[0]
    assert not unreplayed([issue_with(for_v6e, generations=("v6e",))])
    repro_recorded_for(tmp_path / "finding", "s", "v5e")
    repro_recorded_for(tmp_path / "finding", "t", "7x")
    assert not unreplayed([issue_with(for_v6e)])
    assert not unreplayed([issue_with(repro_recorded_for(tmp_path / "anywhere", "r", generations.NONE))])
