"""Every module-level import among the harness's modules goes down the layers docs/layout.md states (a
function may import upward when it runs)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {
    "rpa_harness": "rpa_harness",
    "spec": "rpa_harness.spec",
    "strategies": "rpa_harness.strategies",
    "reference": "rpa_harness.reference",
    "kernel": "rpa_harness.kernel",
}
# The machinery in three tiers: what the device package reads; the device package, its modules in their
# order; the files and names a run shares, the known-issue catalogue and the failures, above it.
BENEATH_THE_DEVICE = {"", "lowering", "generations", "ahead_of_time", "interpret_compat"}
DEVICE = {
    "processes": 3.11, "compilation": 3.11, "interpreter_reports": 3.11, "endings": 3.11,
    "chip": 3.12, "backends": 3.13, "owner": 3.14, "": 3.15,
}  # fmt: skip
ABOVE_THE_DEVICE = {
    "runlog", "progress", "property_names", "repro", "report_sections", "snippets", "known_issues", "failures",
}  # fmt: skip
RUNNING = {"recording", "run_settings", "bench", "tuning", "bug_report", "plugin", "chip", "drawn"}


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [
                part for part in path.relative_to(ROOT / folder).with_suffix("").parts if part != "__init__"
            ]
            found[".".join([package, *parts])] = path
    return found


def layer(module: str) -> float:
    """docs/layout.md's layer of a module, as a number that grows upward."""
    parts = module.split(".")[1:] or [""]
    top = parts[0]
    if top == "spec":
        return 1
    if top in ("strategies", "reference", "kernel"):
        return 2
    if top in BENEATH_THE_DEVICE:
        return 3
    if top == "device":
        return DEVICE[parts[1] if len(parts) > 1 else ""]
    if top in ABOVE_THE_DEVICE:
        return 3.2
    if top == "cache_judge":
        return 4.1
    if top == "targets":
        inner = parts[1] if len(parts) > 1 else ""
        return {"": 4.0, "layouts": 4.0, "tpu_inference": 4.2}.get(inner, 4.4)
    if top == "checks":
        return 5
    if top in RUNNING:
        return 6
    if top == "cli":
        return 7
    raise AssertionError(f"{module} is in none of docs/layout.md's layers: name its layer there and here")


def imported(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module:
        return [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return []


def test_no_module_imports_from_a_layer_above_its_own():
    known = modules()

    def resolve(name: str) -> str | None:
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in known else None

    upward = []
    for module, path in sorted(known.items()):
        for node in ast.parse(path.read_text()).body:
            for name in imported(node):
                target = resolve(name) if name.startswith("rpa_harness") else None
                if (
                    target
                    and target != module
                    and not module.startswith(target + ".")
                    and layer(target) > layer(module)
                ):
                    upward.append(
                        f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})"
                    )
    assert upward == [], "\n".join(upward)
