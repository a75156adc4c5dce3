"""The device is reached one way (``rpa_harness.device``, docs/layout.md): no module outside the package
starts or signals a child process, or waits for a computation on a chip, by itself.

A child process started elsewhere would run in this process's session (ending it would leave what it
started, a pytest worker or a chip owner, holding the chip), and a kernel call made elsewhere would run
without the known-good call and the watchdog: a faulted chip blames the case, a hang never ends.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEVICE = ROOT / "rpa_harness" / "device"
SCANNED = ("rpa_harness", "kernel", "reference", "strategies", "spec", "benchmarks", "mutants")

PROCESS_MODULES = {"subprocess", "multiprocessing"}
# os's calls that start, replace or signal a process.
PROCESS_CALLS = ("fork", "forkpty", "kill", "killpg", "system", "popen", "exec", "spawn", "posix_spawn")


def scanned() -> dict[str, ast.Module]:
    paths = [path for folder in SCANNED for path in (ROOT / folder).rglob("*.py")]
    paths += (ROOT / "ci").glob("*.py")
    return {
        str(path.relative_to(ROOT)): ast.parse(path.read_text())
        for path in sorted(paths)
        if DEVICE not in path.parents
    }


def is_process_call(name: str) -> bool:
    return name.startswith(PROCESS_CALLS)


def process_uses(tree: ast.Module) -> list[str]:
    """Where ``tree`` imports a process module, calls os's process functions, or names ``Popen`` or
    ``concurrent.futures.ProcessPoolExecutor``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                f"line {node.lineno}: import {alias.name}"
                for alias in node.names
                if alias.name.split(".")[0] in PROCESS_MODULES
            ]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in PROCESS_MODULES:
                found.append(f"line {node.lineno}: from {node.module} import ...")
            elif node.module == "os":
                found += [
                    f"line {node.lineno}: from os import {alias.name}"
                    for alias in node.names
                    if is_process_call(alias.name)
                ]
        elif isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "os" and is_process_call(node.attr):
                found.append(f"line {node.lineno}: os.{node.attr}")
            elif node.attr in ("Popen", "ProcessPoolExecutor"):
                found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id == "Popen":
            found.append(f"line {node.lineno}: Popen")
    return found


def names_by_line(node: ast.AST) -> list[tuple[str, int]]:
    return [
        (sub.attr if isinstance(sub, ast.Attribute) else sub.id, sub.lineno)
        for sub in ast.walk(node)
        if isinstance(sub, ast.Attribute | ast.Name)
    ]


def waits_outside_an_interpreter(tree: ast.Module) -> list[str]:
    """Where ``tree`` waits for a computation (``block_until_ready``) in a function that does not force the
    TPU interpreter (``force_tpu_interpret_mode``): a call that may run on a chip, made bare. The module's
    own statements count as one function."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    statements = [node for node in tree.body if not isinstance(node, (*functions, ast.ClassDef))]
    scopes = [ast.Module(body=statements, type_ignores=[])]
    scopes += [node for node in ast.walk(tree) if isinstance(node, functions)]
    found = set()
    for scope in scopes:
        names = names_by_line(scope)
        if all(name != "force_tpu_interpret_mode" for name, _ in names):
            found |= {
                f"line {line}: block_until_ready" for name, line in names if name == "block_until_ready"
            }
    return sorted(found)


def test_no_module_outside_the_device_package_starts_or_signals_a_process():
    modules = scanned()
    found = {path: uses for path, tree in modules.items() if (uses := process_uses(tree))}
    assert found == {}, "start and end child processes with rpa_harness.device.processes"


def test_no_module_outside_the_device_package_waits_for_a_call_on_a_chip():
    """A computation waited for outside ``rpa_harness.device`` is one on an interpreter its function forces;
    a call on a chip goes through ``Backend.run``, ``Backend.timed`` or ``Backend.guarded``."""
    modules = scanned()
    found = {path: waits for path, tree in modules.items() if (waits := waits_outside_an_interpreter(tree))}
    assert found == {}, "make kernel calls on a chip through rpa_harness.device.Backend"


def test_the_checks_see_what_they_look_for():
    starts = ast.parse(
        "import subprocess\nimport os\nos.killpg(1, 9)\nfrom multiprocessing import Process\nx.Popen([])\n"
    )
    assert len(process_uses(starts)) == 4
    bare = ast.parse("import jax\ndef timed(call):\n    jax.block_until_ready(call())\n")
    interpreted = ast.parse(
        "def timed(call):\n    with pltpu.force_tpu_interpret_mode(True):\n        call().block_until_ready()\n"
    )
    assert waits_outside_an_interpreter(bare) == ["line 3: block_until_ready"]
    assert waits_outside_an_interpreter(interpreted) == []
