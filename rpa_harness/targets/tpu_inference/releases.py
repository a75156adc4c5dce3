"""Which tpu-inference release is installed, and which API its v3 kernels have.

A serving stack pins a tpu-inference release and upgrades it rarely, so the targets drive whichever release
is installed (docs/tpu-inference-releases.md). What a release's kernel takes is read from the installed
kernel file's signature, never from the version string: a local build or a patched copy of a release is
judged by what it is. Reading the source (``ast``) rather than importing it keeps the targets importable
where tpu-inference is not installed, and lets a profile say what it draws before the kernel loads.

The releases' APIs (tpu-inference 0.11.1 to 0.32.0):
- 0.11.1 to 0.13.x: upstream's block options (``num_kv_pages_per_block``, ``num_queries_per_block``);
- 0.18.0 on: per-kernel block tuples (``d_block_sizes``, ``p_block_sizes``, ``m_block_sizes``) and the
  options ``use_causal_mask``, ``skip_kv_mask`` and ``out_dtype``;
- 0.22.1 on: ``update_kv_cache`` (a layer that shares another layer's cache).
"""

import ast
import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

NOT_INSTALLED = "not installed"
V3_PACKAGE = ("tpu_inference", "kernels", "ragged_paged_attention", "v3")


def installed_version() -> str:
    """tpu-inference's installed version (the first on ``sys.path``), or ``not installed``."""
    try:
        return importlib.metadata.version("tpu-inference")
    except importlib.metadata.PackageNotFoundError:
        return NOT_INSTALLED


def v3_file(name: str) -> Path | None:
    """The installed file ``name`` of v3's package (``kernel.py``, ``kernel_hd64.py``), found without
    running ``tpu_inference/__init__.py`` (it imports vllm); None where it is not installed."""
    loaded = sys.modules.get(V3_PACKAGE[0])  # the adapter's stub package, once a kernel module loaded
    if loaded is not None:
        folders = list(getattr(loaded, "__path__", []))
    else:
        spec = importlib.util.find_spec(V3_PACKAGE[0])
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        return None
    path = Path(folders[0]).joinpath(*V3_PACKAGE[1:], name)
    return path if path.is_file() else None


@functools.cache
def _parameters(path: Path, function: str) -> tuple[str, ...]:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            arguments = node.args
            return tuple(a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs))
    raise LookupError(f"{path} defines no function {function!r}")


@dataclasses.dataclass(frozen=True)
class V3Api:
    """What the installed v3 kernel's ``ragged_paged_attention`` takes (its signature)."""

    parameters: tuple[str, ...]

    @property
    def block_tuples(self) -> bool:
        """Per-kernel block tuples (0.18.0 on); otherwise upstream's two block options."""
        return "d_block_sizes" in self.parameters

    @property
    def update_kv_cache(self) -> bool:
        """Whether the cache update can be turned off (0.22.1 on)."""
        return "update_kv_cache" in self.parameters

    def takes(self, option: str) -> bool:
        return option in self.parameters


def v3_api(kernel_file: str = "kernel.py", function: str = "ragged_paged_attention") -> V3Api | None:
    """The API of the installed kernel in ``kernel_file``, or None where tpu-inference is not installed."""
    path = v3_file(kernel_file)
    return None if path is None else V3Api(_parameters(path, function))


@functools.cache
def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def kernel_digest(kernel_file: str = "kernel.py") -> str | None:
    """The first 12 hex digits of the installed kernel file's SHA-256: which of the releases' distinct
    kernels runs (several releases ship the same file)."""
    path = v3_file(kernel_file)
    return None if path is None else _digest(path)


def run_header(label: str = "", kernel_file: str = "kernel.py") -> str:
    """What the run header shows: ``tpu-inference 0.19.0 (v3/kernel.py 07999f4d126f)``, and ``label``."""
    digest = kernel_digest(kernel_file)
    what = ", ".join(part for part in (f"v3/{kernel_file} {digest}" if digest else "", label) if part)
    return f"tpu-inference {installed_version()}" + (f" ({what})" if what else "")
