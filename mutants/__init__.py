"""Seeded-bug variants of our kernel, each importable as a target: ``--rpa-target=mutants.NAME``.

Each mutant is built at import time from the *current* source of ``kernel/pallas_rpa.py`` and
``spec/interface.py`` (the validators) with one patch from ``mutants.catalogue`` applied, exec'd into fresh modules, so
the production kernel carries no bug switches. A kernel patch gives a module whose kernel is buggy and
whose validator is ours; a validation patch gives a module whose validator (and the static checks the
kernel runs) is buggy and whose kernel computes correctly. Every module is registered in ``sys.modules``
as ``mutants.NAME`` and declares the capabilities of our kernel.

Public API: ``MUTANTS`` (the catalogue), ``TWO_BUGS`` (a kernel with two bugs), ``BY_NAME``,
``patched_source(mutant)``, ``build(mutant)``, ``PatchError``; and one attribute per mutant name (its
module).
"""

import linecache
import sys
import types
from pathlib import Path

from mutants.catalogue import KERNEL_FILE, MUTANTS, TWO_BUGS, VALIDATION_FILE, Mutant
from rpa_harness.targets import bundled

REPO_ROOT = Path(__file__).resolve().parent.parent
BY_NAME = {mutant.name: mutant for mutant in MUTANTS}


class PatchError(Exception):
    """A patch that no longer applies to the kernel source; the message says which and why."""


def patched_source(mutant: Mutant) -> str:
    """The source of ``mutant.file`` with its patches applied; each original text must occur exactly once."""
    source = (REPO_ROOT / mutant.file).read_text()
    for original, replacement in mutant.patches:
        count = source.count(original)
        if count != 1:
            raise PatchError(
                f"mutant {mutant.name}: its original text occurs {count} times in {mutant.file} (expected "
                f"exactly once): {original!r}. The kernel source changed; update the patch in "
                "mutants/catalogue.py to the new code."
            )
        source = source.replace(original, replacement)
    return source


def _exec_module(module_name: str, source: str, label: str) -> types.ModuleType:
    """Runs ``source`` as a new module; its text is put in linecache so tracebacks show the patched lines."""
    filename = f"<{label}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    module = types.ModuleType(module_name)
    module.__file__ = filename
    exec(compile(source, filename, "exec"), module.__dict__)
    return module


def _as_target(module: types.ModuleType, mutant, kernel: str, profile: dict) -> types.ModuleType:
    """``module``, a patched ``kernel``, as a target: the ``profile`` (``RPA_HARNESS_*`` attributes) of the
    kernel it mutates, the mutant as ``MUTANT`` and a docstring naming both."""
    vars(module).update(
        profile, MUTANT=mutant, __doc__=f"Mutant {mutant.name} of {kernel}: {mutant.description}."
    )
    return module


def build(mutant: Mutant) -> types.ModuleType:
    """The target module of one mutant (not registered anywhere)."""
    name = f"{__name__}.{mutant.name}"
    validation_source = (REPO_ROOT / VALIDATION_FILE).read_text()
    kernel_source = (REPO_ROOT / KERNEL_FILE).read_text()
    if mutant.file == VALIDATION_FILE:
        validation_source = patched_source(mutant)
    elif mutant.file == KERNEL_FILE:
        kernel_source = patched_source(mutant)
    else:
        raise PatchError(
            f"mutant {mutant.name}: file {mutant.file!r} is not {KERNEL_FILE} or {VALIDATION_FILE}"
        )
    validation = _exec_module(
        f"{name}_validation", validation_source, f"mutant {mutant.name}: {VALIDATION_FILE}"
    )
    module = _exec_module(name, kernel_source, f"mutant {mutant.name}: {KERNEL_FILE}")
    # The kernel source imports the validator from rpa_harness.spec.interface; point it at this mutant's instead.
    module.static_validate_inputs = validation.static_validate_inputs
    module.dynamic_validate_inputs = validation.dynamic_validate_inputs
    return _as_target(
        module, mutant, "our kernel", {"RPA_HARNESS_CAPABILITIES": bundled.RPA_HARNESS_CAPABILITIES}
    )


def _register_all() -> None:
    for mutant in (*MUTANTS, TWO_BUGS):
        module = build(mutant)
        sys.modules[module.__name__] = module
        globals()[mutant.name] = module


_register_all()
