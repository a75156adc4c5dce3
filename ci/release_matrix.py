"""The ci profile against every tpu-inference release with a distinct RPA v3 or head_dim-64 kernel.

A serving stack pins a tpu-inference release and upgrades it rarely, so the kernel it runs is often not the
newest. Many releases ship the same kernel file, so the releases are grouped by the SHA-256 of the file
(``v3/kernel.py`` for v3, ``v3/kernel_hd64.py`` for hd64) and the newest release of each group runs; one row
per run, printed as a Markdown table (docs/tpu-inference-releases.md).

  python ci/release_matrix.py                                  # every distinct kernel, both targets
  python ci/release_matrix.py --list                           # the groups only, nothing runs
  python ci/release_matrix.py --releases 0.19.0,0.22.1 --targets v3 --table matrix.md
  python ci/release_matrix.py --dry-run                        # the commands each row would run

Each release is installed without its dependencies (its package depends on vllm, which the kernels do not
need) into its own folder outside the repo, and a row runs ``rpa-harness run`` with that folder first on
PYTHONPATH, with this script's Python. Exit 0 when every row passed, 1 when any failed or errored, 2 when a
release could not be installed, 4 for a usage error (one line).
"""

import argparse
import collections
import dataclasses
import hashlib
import importlib.util
import os
import re
import shlex
import shutil
import signal
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from rpa_harness.device import processes

REPO_ROOT = Path(__file__).resolve().parent.parent
# The PyPI releases whose wheel has v3's kernel.py (kernel_hd64.py from 0.12.0 on), oldest first.
RELEASES = (
    "0.11.1", "0.12.0", "0.13.2", "0.13.2.post6", "0.13.3", "0.18.0", "0.19.0", "0.20.0", "0.21.0",
    "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0",
    "0.32.0",
)  # fmt: skip
RELEASE_PATTERN = re.compile(r"\d+(\.\d+)*(\.post\d+)?")
V3_FOLDER = ("tpu_inference", "kernels", "ragged_paged_attention", "v3")
DIGEST_LENGTH = 12  # hex digits shown, as the harness's run header shows them
# The ci profile as the campaigns in docs/measurements.md run it: both declared generations, every bucket
# the ci profile draws (the long corners included).
GENERATIONS = "v5e,v6e"
BUCKETS = "tiny,small,long"
PASSED, FAILED, INSTALL_FAILED, USAGE = 0, 1, 2, 4  # this script's exit statuses


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as --targets names it
    module: str  # the harness target
    kernel_file: str  # in tpu_inference/kernels/ragged_paged_attention/v3/


TARGETS = {
    target.name: target
    for target in (
        Target("v3", "rpa_harness.targets.tpu_inference_v3", "kernel.py"),
        Target("hd64", "rpa_harness.targets.tpu_inference_v3_hd64", "kernel_hd64.py"),
    )
}


class UsageError(Exception):
    """A command line this script cannot act on: one line, exit 4."""


class InstallError(Exception):
    """pip could not install a release (a release that does not exist, no network): one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def release_key(release: str) -> tuple[int, ...]:
    """Orders releases as PyPI does for the forms they take here: 0.13.2 < 0.13.2.post6 < 0.13.3."""
    return tuple(int(part.removeprefix("post")) for part in release.split("."))


def default_cache_dir() -> Path:
    # `${XDG_CACHE_HOME:-~/.cache}`: an empty XDG_CACHE_HOME counts as unset, as in the shell.
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rpa-harness" / "tpu-inference"


def is_installed(folder: Path, release: str) -> bool:
    """A finished install leaves the release's metadata folder; an interrupted one never gets renamed."""
    return (folder / f"tpu_inference-{release}.dist-info").is_dir()


def install(release: str, *, cache_dir: Path) -> Path:
    """The release's folder, installed there first if it is not yet (pip --no-deps: a few MB, seconds).

    pip installs into a sibling folder that is renamed when it is complete, so an interrupted install is
    never taken for a release."""
    folder = cache_dir / release
    if is_installed(folder, release):
        return folder
    partial = folder.with_name(f"{release}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    print(f"release_matrix: installing tpu-inference=={release} into {folder}", file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(partial)]
    result = processes.run([*command, f"tpu-inference=={release}"])
    if result.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise InstallError(f"cannot install tpu-inference=={release}: {last_line(result.stderr)}")
    shutil.rmtree(folder, ignore_errors=True)  # a folder without the release's metadata is not the release
    partial.rename(folder)
    return folder


# A v3 module the kernel file imports from its own folder (its util.py, its tuned table).
SIBLING_IMPORT = re.compile(r"ragged_paged_attention\.v3\.(\w+)")


def kernel_digest(folder: Path, target: Target) -> str | None:
    """The full SHA-256 of the target's kernel file in an installed release; None where it has none."""
    path = folder.joinpath(*V3_FOLDER, target.kernel_file)
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def sibling_digests(folder: Path, target: Target) -> dict[str, str]:
    """The full SHA-256 of each v3 module the target's kernel file imports (``util.py`` -> digest)."""
    kernel = folder.joinpath(*V3_FOLDER, target.kernel_file)
    names = sorted(set(SIBLING_IMPORT.findall(kernel.read_text()))) if kernel.is_file() else []
    return {
        f"{name}.py": hashlib.sha256(path.read_bytes()).hexdigest()
        for name in names
        if (path := kernel.with_name(f"{name}.py")).is_file()
    }


@dataclasses.dataclass
class Group:
    """The releases that ship one kernel file and the same v3 modules it imports, byte for byte."""

    target: Target
    digest: str  # the kernel file's, as the run header names it
    siblings: dict[str, str]  # the imported v3 modules' digests
    releases: list[str]  # oldest first

    @property
    def newest(self) -> str:
        return self.releases[-1]


def group_by_kernel(folders: dict[str, Path], target: Target) -> list[Group]:
    """The releases in ``folders`` (release -> installed folder) grouped by the digests of the target's
    kernel file and of the v3 modules it imports (a release that changes only its util.py runs other code),
    in release order; releases without that file are in no group."""
    groups: dict[tuple, Group] = {}
    for release in sorted(folders, key=release_key):
        digest = kernel_digest(folders[release], target)
        if digest is not None:
            siblings = sibling_digests(folders[release], target)
            key = (digest, *sorted(siblings.items()))
            groups.setdefault(key, Group(target, digest, siblings, [])).releases.append(release)
    return list(groups.values())


@dataclasses.dataclass
class RunSummary:
    """What a row's log and JUnit file say about its run."""

    examples: int | None = None  # the summary table's examples column, summed; None without a table
    counts: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    failed_tests: list[str] = dataclasses.field(default_factory=list)
    known_issues: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> its replays' outcomes
    repros: list[str] = dataclasses.field(default_factory=list)  # as the summary names them
    ran: str | None = None  # the kernel's digest as the run header names it: what the target loaded
    last_line: str = ""


SUMMARY_ROW = re.compile(r"^(?P<name>\S.*?)\s+(?P<examples>\d+)\s+(?P<result>passed|FAILED|skipped|xfailed)$")
KNOWN_ISSUE_ROW = re.compile(r"^(?P<name>\S+)\s+(?P<avoided>\d+)\s+(?P<replay>.*)$")
REPRODUCES = ": reproduces"  # a replay's outcome in the known-issues table, "LABEL: reproduces"
# How the run header names the kernel the target loaded (rpa_harness.targets.tpu_inference.releases):
# "tpu-inference 0.19.0 (v3/kernel.py 07999f4d126f)".
LOADED_KERNEL = re.compile(r"tpu-inference \S+ \(v3/\S+ (?P<digest>[0-9a-f]{12})\)")


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def read_log(text: str) -> RunSummary:
    """The examples, repros and known issues from the tables ``rpa-harness run`` ends with (rpa_harness/cli.py:
    ``summary`` then ``known_issues_summary``); pytest's own output before them is not read, since a failure
    message can quote anything."""
    found = RunSummary(last_line=last_line(text))
    lines = text.splitlines()
    if "rpa-harness summary" not in lines:
        return found
    start = len(lines) - 1 - lines[::-1].index("rpa-harness summary")
    section = "header"
    header: list[str] = []
    issue = None
    for line in lines[start + 1 :]:
        if section == "header" and re.match(r"^property\s+examples\s+result$", line):
            section, found.examples = "properties", 0
            loaded = LOADED_KERNEL.search(" ".join(" ".join(header).split()))  # its lines wrap anywhere
            found.ran = loaded["digest"] if loaded else None
        elif section == "header":
            header.append(line)
        elif section == "properties":
            row = SUMMARY_ROW.match(line)
            if row:
                found.examples = (found.examples or 0) + int(row["examples"])
            elif line.strip().startswith("repro: "):
                found.repros.append(line.strip().removeprefix("repro: "))
            elif line.startswith("known issues declared ("):
                section = "issue header"
        elif section == "issue header":  # the column titles
            section = "issues"
        elif section == "issues":
            if not line.strip() or line.startswith("pytest command:"):
                break
            row = KNOWN_ISSUE_ROW.match(line)
            if row:
                issue = row["name"]
                found.known_issues[issue] = row["replay"]
            elif issue is not None:  # a long row wraps, its continuation indented
                found.known_issues[issue] += " " + line.strip()
    return found


def read_junit(path: Path, found: RunSummary) -> None:
    """pytest's counts (named as its closing line names them) and the failed tests, from the JUnit file."""
    try:
        cases = list(ElementTree.parse(path).iter("testcase"))
    except (OSError, ElementTree.ParseError):
        return
    for case in cases:
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        found.counts[outcome] += 1
        if outcome in ("failed", "error"):
            found.failed_tests.append(case.get("name", "?"))


@dataclasses.dataclass
class Row:
    """One line of the table: one release's kernel under one target, and what its run found."""

    release: str
    target: Target
    digest: str
    folder: Path  # where the row's log, JUnit file and repros go
    exit_code: int | None = None  # None: not run (a dry run)
    seconds: float = 0.0
    summary: RunSummary = dataclasses.field(default_factory=RunSummary)

    @property
    def log(self) -> Path:
        return self.folder / "run.log"

    @property
    def junit(self) -> Path:
        return self.folder / "junit.xml"

    @property
    def repro_dir(self) -> Path:
        return self.folder / "repros"

    @property
    def loaded_another_kernel(self) -> bool:
        """The run header names a kernel other than the release's: something ahead of the release's folder on
        the path (an install in the current folder, a .pth file) was tested, not the release."""
        return self.summary.ran is not None and not self.digest.startswith(self.summary.ran)

    @property
    def result(self) -> str:
        """pass (exit 0), FAIL (exit 1: a property failed), error (any other exit, or another kernel tested:
        the row does not say anything about its release)."""
        if self.loaded_another_kernel:
            return "error"
        if self.exit_code == PASSED:
            return "pass"
        return "FAIL" if self.exit_code == FAILED else "error"


def row_folder(release: str, target: Target, *, out: Path) -> Path:
    return out / f"{release}-{target.name}"


def run_command(row: Row) -> list[str]:
    """``rpa-harness run`` with this script's Python (the harness is installed in it)."""
    return [
        sys.executable, "-m", "rpa_harness.cli", "run", "--profile", "ci", "--target", row.target.module,
        "--tpu-generation", GENERATIONS, "--buckets", BUCKETS,
        "--junit", str(row.junit.resolve()), "--repro-dir", str(row.repro_dir.resolve()),
    ]  # fmt: skip


def run_environment(*, release_dir: Path) -> dict[str, str]:
    """The variables a row sets: the release first on PYTHONPATH (ahead of any tpu-inference installed in
    this Python), and a compilation cache outside the row folders that every row and later run shares
    (jax keys it by what it compiles, so releases cannot mix), unless one is set already."""
    paths = [str(release_dir.resolve()), *filter(None, [os.environ.get("PYTHONPATH")])]
    variables = {"PYTHONPATH": os.pathsep.join(paths)}
    if not os.environ.get("RPA_COMPILATION_CACHE"):
        variables["RPA_COMPILATION_CACHE"] = str(
            default_cache_dir().parent / "release-matrix-compilation-cache"
        )
    return variables


def shell_line(row: Row, *, release_dir: Path) -> str:
    """The row's command as one shell line (a dry run prints it; the row's log starts with it)."""
    variables = " ".join(f"{k}={shlex.quote(v)}" for k, v in run_environment(release_dir=release_dir).items())
    return f"cd {shlex.quote(str(row.folder))} && {variables} {shlex.join(run_command(row))}"


def run_row(row: Row, *, release_dir: Path) -> None:
    """Runs the row from its own folder (a rerun replaces it), so that whatever the run writes beside its
    log, JUnit file and repros stays there too; reads its results into the row."""
    shutil.rmtree(row.folder, ignore_errors=True)
    row.folder.mkdir(parents=True)
    env = {**os.environ, **run_environment(release_dir=release_dir)}
    started = time.monotonic()
    with open(row.log, "w") as log:
        log.write(f"$ {shell_line(row, release_dir=release_dir)}\n")
        log.flush()
        process = processes.run(run_command(row), cwd=row.folder, env=env, output=log, first=signal.SIGINT)
    row.seconds = time.monotonic() - started
    row.exit_code = process.returncode
    row.summary = read_log(row.log.read_text(errors="replace"))
    read_junit(row.junit, row.summary)


def _counts(counts: collections.Counter[str]) -> str:
    order = ("passed", "failed", "error", "skipped", "xfailed")
    return ", ".join(f"{counts[name]} {name}" for name in order if counts[name])


def findings(row: Row) -> str:
    """The declared known issues and whether each reproduced; a failure's repros (or failed tests where
    none was written); an error's last line."""
    summary = row.summary
    parts = []
    if row.loaded_another_kernel:
        parts.append(f"tested kernel {summary.ran}, not the release's")
    elif row.result == "error":
        parts.append(f"last line: {summary.last_line or '(no output)'}")
    if summary.known_issues:
        reproducing = [name for name, replay in summary.known_issues.items() if REPRODUCES in replay]
        parts.append(
            f"{len(reproducing)} of {len(summary.known_issues)} declared known issues reproduce"
            + (f": {', '.join(reproducing)}" if reproducing else "")
        )
        parts += [
            f"{name}: {replay}" for name, replay in summary.known_issues.items() if name not in reproducing
        ]
    elif summary.examples is not None:
        parts.append("no known issues declared")
    if row.result == "FAIL":
        parts += [f"repro: {path}" for path in summary.repros] or [
            f"failed: {test}" for test in summary.failed_tests
        ]
    return "; ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_table(rows: list[Row]) -> str:
    """The Markdown table, one line per row."""
    lines = [
        "| release | target | kernel digest | examples | result | wall s | findings |",
        "|---|---|---|---:|---|---:|---|",
    ]
    for row in rows:
        counts = _counts(row.summary.counts)
        result = f"{row.result} (exit {row.exit_code})" if row.result == "error" else row.result
        cells = (
            row.release,
            row.target.name,
            row.digest[:DIGEST_LENGTH],
            "-" if row.summary.examples is None else str(row.summary.examples),
            f"{result} ({counts})" if counts else result,
            f"{row.seconds:.0f}",
            findings(row) or "-",
        )
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(lines)


def render_groups(groups: list[Group], *, chosen: set[tuple[str, str]]) -> str:
    """``--list``: per target, each distinct kernel and the releases that ship it, the one that runs marked."""
    lines = []
    for target in TARGETS.values():
        mine = [group for group in groups if group.target is target]
        if not mine:
            continue
        shipped = sum(len(group.releases) for group in mine)
        lines.append(f"{target.name} (v3/{target.kernel_file}): {len(mine)} distinct in {shipped} releases")
        for group in mine:
            releases = [f"{r}*" if (r, target.name) in chosen else r for r in group.releases]
            line = f"  {group.digest[:DIGEST_LENGTH]}  {', '.join(releases)}"
            if sum(other.digest == group.digest for other in mine) > 1:  # the same kernel file, other modules
                line += "  (" + ", ".join(f"{n} {d[:DIGEST_LENGTH]}" for n, d in group.siblings.items()) + ")"
            lines.append(line)
    lines.append("* runs")
    return "\n".join(lines)


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(
        prog="release_matrix",
        description="Run the harness's ci profile against each tpu-inference release with a distinct v3 or "
        "head_dim-64 kernel and print a Markdown table.",
    )
    parser.add_argument(
        "--releases", help="comma-separated releases to run (default: the newest of each distinct kernel)"
    )
    parser.add_argument("--targets", default="v3,hd64", help="comma-separated: v3, hd64 (default both)")
    parser.add_argument(
        "--cache-dir", type=Path, default=default_cache_dir(),
        help="one folder per installed release (default ${XDG_CACHE_HOME:-~/.cache}/rpa-harness/tpu-inference)",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=Path("release-matrix"),
        help="one folder per row: run.log, junit.xml, repros/ (default release-matrix/)",
    )  # fmt: skip
    parser.add_argument("--table", type=Path, help="also write the Markdown table to this file")
    parser.add_argument(
        "--list", action="store_true", help="print the groups of releases by kernel digest; run nothing"
    )
    parser.add_argument(
        "--dry-run", action="store_true",
        help="print each row's command; run nothing (missing releases are still installed: their kernels decide)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.targets = [name.strip() for name in args.targets.split(",") if name.strip()]
    unknown = [name for name in args.targets if name not in TARGETS]
    if unknown or not args.targets:
        raise UsageError(f"--targets: {', '.join(unknown) or 'none given'}; choose from {', '.join(TARGETS)}")
    if args.releases is not None:
        args.releases = list(dict.fromkeys(r.strip() for r in args.releases.split(",") if r.strip()))
        malformed = [release for release in args.releases if not RELEASE_PATTERN.fullmatch(release)]
        if malformed or not args.releases:
            raise UsageError(
                f"--releases: not a release: {', '.join(malformed) or 'none given'} (e.g. 0.19.0)"
            )
    cache_dir = args.cache_dir.resolve()
    if cache_dir == REPO_ROOT or REPO_ROOT in cache_dir.parents:
        raise UsageError(f"--cache-dir {args.cache_dir}: inside the repo; releases are installed outside it")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_arguments(argv)
    except UsageError as error:
        print(f"release_matrix: {error} (see --help)", file=sys.stderr)
        return USAGE
    targets = [TARGETS[name] for name in args.targets]
    named = args.releases
    try:
        folders = {release: install(release, cache_dir=args.cache_dir) for release in named or RELEASES}
    except InstallError as error:
        print(f"release_matrix: {error}", file=sys.stderr)
        return INSTALL_FAILED
    groups = [group for target in targets for group in group_by_kernel(folders, target)]
    digests = {(release, group.target.name): group.digest for group in groups for release in group.releases}
    if named:
        chosen = [(release, target) for target in targets for release in named]
        for release, target in chosen:
            if (release, target.name) not in digests:
                print(
                    f"release_matrix: {release} ships no v3/{target.kernel_file}: no {target.name} row",
                    file=sys.stderr,
                )
        chosen = [(release, target) for release, target in chosen if (release, target.name) in digests]
    else:
        chosen = [(group.newest, group.target) for group in groups]
    if args.list:
        print(render_groups(groups, chosen={(release, target.name) for release, target in chosen}))
        return PASSED
    rows = [
        Row(release, target, digests[release, target.name], row_folder(release, target, out=args.out))
        for release, target in chosen
    ]
    if args.dry_run:
        for row in rows:
            print(shell_line(row, release_dir=folders[row.release]))
        return PASSED
    if importlib.util.find_spec("rpa_harness") is None:  # every row would end in the same import error
        print(
            f"release_matrix: the harness is not installed in {sys.executable} (pip install -e .)",
            file=sys.stderr,
        )
        return USAGE
    for number, row in enumerate(rows, 1):
        print(
            f"release_matrix: [{number}/{len(rows)}] {row.release} {row.target.name} "
            f"(kernel {row.digest[:DIGEST_LENGTH]}): log in {row.log}",
            file=sys.stderr,
            flush=True,
        )
        run_row(row, release_dir=folders[row.release])
        print(f"release_matrix: {row.result} in {row.seconds:.0f} s", file=sys.stderr, flush=True)
    table = render_table(rows)
    print(table)
    if args.table:
        args.table.write_text(table + "\n")
    return PASSED if all(row.result == "pass" for row in rows) else FAILED


if __name__ == "__main__":
    sys.exit(main())
