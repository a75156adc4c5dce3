"""Loading tpu-inference's kernel modules and calling their kernels under jit: what every target of the
family (v3 and its forks, MLA, batched and stacked RPA, v2) runs its kernel through.

A kernel module is imported without running ``tpu_inference/__init__.py``, which imports vllm: tpu-inference
is installed with ``--no-deps`` (its kernels need only jax), and the names its kernel modules ask of vllm's
side (its logger, the chip's name) are stood in. Each kernel function is jitted once per option set.
"""

import importlib.util
import logging
import os
import sys
import types

import jax
from jax._src import dtypes as jax_dtypes

from rpa_harness.targets.tpu_inference.releases import NOT_INSTALLED, installed_version

PINNED_RELEASE = "0.32.0"  # the release CI tests and the findings' reports were made on
INSTALL_COMMAND = f"pip install --no-deps tpu-inference=={PINNED_RELEASE}"
# v3's kernel module: v3's target runs it, and its reference serves kernels that ship none (batched RPA).
V3_KERNEL_MODULE = "tpu_inference.kernels.ragged_paged_attention.v3.kernel"


def load_kernel_module(name: str) -> types.ModuleType:
    """Imports a module of tpu-inference's v3 kernels (``name``) without running ``tpu_inference/__init__.py``
    (it imports vllm).

    The package entries are stubs whose ``__path__`` is the installed folder, so the kernel's absolute
    imports of its siblings (``...v3.util``) resolve to the installed files.
    """
    if "tpu_inference" not in sys.modules:
        spec = importlib.util.find_spec("tpu_inference")  # finds the package without running it
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(
                f"tpu-inference is not installed; install its RPA v3 kernel with `{INSTALL_COMMAND}` "
                "(--no-deps: the kernel needs only jax, and the package's own dependencies include vllm)"
            )
        package, path = "", list(spec.submodule_search_locations)[0]
        for part in ("tpu_inference", "kernels", "ragged_paged_attention", "v3"):
            package, path = (f"{package}.{part}", os.path.join(path, part)) if package else (part, path)
            stub = types.ModuleType(package)
            stub.__path__ = [path]
            sys.modules.setdefault(package, stub)
    prepare_to_load()  # 0.11.1 to 0.13.x: a jax name they call, the tuned table's imports
    return importlib.import_module(name)


def provide_dtypes_bit_width() -> None:
    """0.11.1 and 0.12.0's ``v3/util.py`` call ``jax._src.dtypes.bit_width``, which the jax versions the
    harness supports (0.10.2 to 0.12) name ``itemsize_bits``: the old name, where it is absent, for the same
    function (0.13.x's util tries both)."""
    if not hasattr(jax_dtypes, "bit_width"):
        setattr(jax_dtypes, "bit_width", jax_dtypes.itemsize_bits)  # noqa: B010  (a name mypy does not know)


def prepare_to_load() -> None:
    """What an early release's v3 package needs before it is imported here (later releases need neither; both
    are harmless to them)."""
    provide_dtypes_bit_width()
    stand_in_for_tpu_inference_utils()


class OnceLogger:
    """What tpu-inference's kernel modules ask of its logger (vllm's): a ``logging.Logger`` with
    ``warning_once`` and ``info_once`` (the head_dim-64 kernel's tuned table)."""

    def __init__(self, name: str):
        self._logger = logging.getLogger(name)
        self._said: set = set()

    def _once(self, level, message, *args):
        if (message, args) not in self._said:
            self._said.add((message, args))
            self._logger.log(level, message, *args)

    def warning_once(self, message, *args):
        self._once(logging.WARNING, message, *args)

    def info_once(self, message, *args):
        self._once(logging.INFO, message, *args)

    def __getattr__(self, name):  # warning, info, ...: the logger's own
        return getattr(self._logger, name)


def stand_in_for_tpu_inference_logger() -> None:
    """Where vllm is not installed (``--no-deps``), ``tpu_inference.logger`` (vllm's logger, which some of
    tpu-inference's kernel modules import) as a module whose ``init_logger`` gives an ``OnceLogger``: one
    stand-in for every kernel module loaded in the process."""
    if importlib.util.find_spec("vllm") is None and "tpu_inference.logger" not in sys.modules:
        logger = types.ModuleType("tpu_inference.logger")
        logger.init_logger = OnceLogger  # type: ignore[attr-defined]
        sys.modules["tpu_inference.logger"] = logger


def tpu_device_name() -> str:
    """The chip as tpu-inference's tuned tables name it (``TPU v5e``, ``TPU v6e``, ``TPU v5``, ``TPU v7``),
    read from ``jax.devices()`` at each call so that TPU generation emulation answers; off a TPU the
    ``RuntimeError`` tpu-inference's ``get_device_name`` raises."""
    kind = jax.devices()[0].device_kind
    if "TPU" not in kind:
        raise RuntimeError("Expected TPU devices")
    suffix = ""
    for ending, letter in ((" lite", "e"), ("e", "e"), ("p", "p"), ("i", "i")):
        if kind.endswith(ending):
            kind, suffix = kind[: -len(ending)], letter
            break
    if kind.startswith("TPU7") or kind.startswith("TPU8"):
        kind = f"TPU v{kind[3]}"
    return kind + suffix


def stand_in_for_tpu_inference_utils() -> None:
    """The tuned tables (hd64's; v3's before 0.18.0) import ``tpu_inference.logger`` (vllm's logger) and
    ``tpu_inference.utils`` (torch, vllm) for one name each. Where vllm is not installed (``--no-deps``)
    both are stood in: ``init_logger`` (``stand_in_for_tpu_inference_logger``) and ``get_device_name``
    (``tpu_device_name``)."""
    if importlib.util.find_spec("vllm") is not None:
        return
    stand_in_for_tpu_inference_logger()
    if "tpu_inference.utils" not in sys.modules:
        utils = types.ModuleType("tpu_inference.utils")
        utils.get_device_name = tpu_device_name  # type: ignore[attr-defined]
        sys.modules["tpu_inference.utils"] = utils


def install_command() -> str:
    """How to install the release installed here (the pinned one where none is)."""
    version = installed_version()
    return INSTALL_COMMAND if version == NOT_INSTALLED else f"pip install --no-deps tpu-inference=={version}"


_JITTED: dict = {}


def jitted(kernel, kwargs: dict):
    """``kernel`` (a v3 kernel function) under jit, one per option set: v3's kernels donate their inputs to
    their outputs (jit keeps the caller's arrays), and each static configuration compiles once. Keyed by
    each value's type and repr, so that options that compare equal but render differently (``-0.0`` and
    ``0.0``, ``1`` and ``1.0``) keep their own compilation, and the kernel's messages, which render them,
    stay theirs."""
    key = (kernel, *sorted((name, type(value).__name__, repr(value)) for name, value in kwargs.items()))
    if key not in _JITTED:
        _JITTED[key] = jax.jit(lambda *arrays: kernel(*arrays, **kwargs))
    return _JITTED[key]


def device_arrays(args) -> list:
    """A v3 kernel's positional arguments as jax arrays, put on the device without a per-shape compile
    (``targets.as_jax``); an absent optional one (the hd64 kernel without sinks) stays None."""
    return [None if a is None else jax.device_put(a) for a in args]


def run_jitted(function, inputs):
    """``function`` (a kernel function of tpu-inference's) on mapped ``inputs`` (its positional ``args``,
    its keyword ``kwargs``) under ``jitted``, on whatever backend the caller's context selects: how every
    tpu-inference target runs its kernel."""
    return jitted(function, inputs.kwargs)(*device_arrays(inputs.args))
