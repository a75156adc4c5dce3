"""The suite is sorted by kind, and its modules share cases through helpers, never through each other."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
KINDS = ("unit", "end_to_end", "meta", "targets", "properties")


def test_every_test_module_is_in_a_folder_of_its_kind():
    misplaced = [
        str(path.relative_to(TESTS))
        for path in TESTS.rglob("test_*.py")
        if path.relative_to(TESTS).parts[0] not in KINDS
    ]
    assert misplaced == [], f"test modules outside {KINDS}: {misplaced}"


def test_no_test_module_imports_another():
    found = []
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [
                f"{path.relative_to(TESTS)}:{node.lineno}: {name}"
                for name in names
                if any(part.startswith("test_") for part in name.split("."))
            ]
    assert found == [], "shared cases belong in tests/cases.py:\n" + "\n".join(found)
