"""The interpreter compatibility layer as the tests hold it: on for a test module, off for a block of one
test. Test modules that probe the layer's gaps share these (never each other's)."""

import contextlib

from rpa_harness import interpret_compat


@contextlib.contextmanager
def layer_installed():
    """The layer for a block (a module-scoped fixture's), uninstalled after it only where it was not
    installed before: the rest of the process keeps what it had."""
    was_installed = interpret_compat.is_installed()
    interpret_compat.install()
    yield
    if not was_installed:
        interpret_compat.uninstall()


@contextlib.contextmanager
def layer_off():
    """Run without the layer, then put it back (other tests in this process rely on it)."""
    interpret_compat.uninstall()
    try:
        yield
    finally:
        interpret_compat.install()
        assert interpret_compat.is_installed()
