"""The pieces every gap is made of: a replaced attribute that can be put back, and a gap's description."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any


class InternalsMoved(Exception):
    """The jax internals a patch replaces are not the ones it was written against."""


def _held(owner: Any, name: Any) -> Any:
    """What ``owner`` holds under ``name``: an attribute, or a dict's entry."""
    return owner[name] if isinstance(owner, dict) else getattr(owner, name)


@dataclasses.dataclass
class Patch:
    """One replaced attribute (or dict entry) and what to put back."""

    owner: Any
    name: Any
    replacement: Any
    original: Any = None

    @classmethod
    def wrapping(cls, owner: Any, name: Any, wrap: Callable[[Any], Any]) -> Patch:
        """The patch that replaces ``owner``'s ``name`` with ``wrap`` of what it holds now."""
        return cls(owner, name, wrap(_held(owner, name)))

    def apply(self) -> None:
        self.original = self._get()
        self._set(self.replacement)

    def revert(self) -> None:
        if self._get() is not self.replacement:
            warnings.warn(
                f"interpret_compat: {self.owner!r}.{self.name} was replaced by someone else after install();"
                " leaving it as it is.",
                stacklevel=3,
            )
            return
        self._set(self.original)

    def _get(self) -> Any:
        return _held(self.owner, self.name)

    def _set(self, value: Any) -> None:
        if isinstance(self.owner, dict):
            self.owner[self.name] = value
        else:
            setattr(self.owner, self.name, value)


@dataclasses.dataclass(frozen=True)
class Gap:
    """Something a jax interpreter cannot do that TPU kernels need, and the patch that closes it.

    ``probe`` answers whether the running jax has the gap (it runs or inspects the unpatched internals);
    ``check_internals`` raises ``InternalsMoved`` when what the patch replaces has changed shape, and
    ``patches`` builds the replacements. Both may raise on a jax whose private modules moved.
    """

    name: str
    interpreter: str
    symptom: str
    probe: Callable[[], bool]
    check_internals: Callable[[], None]
    patches: Callable[[], list[Patch]]


GapRow = tuple[str, str, Callable[[], bool], Callable[[], None], Callable[[], list[Patch]]]
"""One gap of an interpreter's table: (name, symptom, probe, check_internals, patches)."""


def gap_table(interpreter: str, *rows: GapRow) -> tuple[Gap, ...]:
    """The gaps of ``interpreter``, one for each row of its table."""
    return tuple(
        Gap(name, interpreter, symptom, probe, check_internals, patches)
        for name, symptom, probe, check_internals, patches in rows
    )


def private_modules(paths: dict[str, str]) -> Callable[[], types.SimpleNamespace]:
    """A loader of jax's private modules ``{name: module path}``, imported at its first call and kept:
    importing this package imports none of them, only a gap that needs them does."""

    @functools.cache
    def load() -> types.SimpleNamespace:
        return types.SimpleNamespace(**{name: importlib.import_module(path) for name, path in paths.items()})

    return load


def require(condition: bool, what: str) -> None:
    """Raise InternalsMoved(what) unless ``condition`` holds."""
    if not condition:
        raise InternalsMoved(what)


def require_attributes(owner: Any, *names: str) -> None:
    missing = [name for name in names if not hasattr(owner, name)]
    require(not missing, f"{getattr(owner, '__name__', owner)} has no {', '.join(missing)}")


def parameter_names(function: Callable) -> list[str]:
    return list(inspect.signature(function).parameters)


def require_parameters(function: Callable, expected_prefix: Sequence[str | None], where: str) -> None:
    """``function``'s leading parameters are ``expected_prefix`` (a ``None`` entry matches any name)."""
    names = parameter_names(function)
    matches = len(names) >= len(expected_prefix) and all(
        want is None or want == got for want, got in zip(expected_prefix, names, strict=False)
    )
    require(matches, f"{where} takes ({', '.join(names)}), expected it to start with {expected_prefix}")
