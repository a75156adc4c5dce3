"""This checkout's tests run on the installed harness: its pytest plugin (``rpa_harness.plugin``, entry point
``pytest11``) provides every option, profile and fixture, and pyproject.toml's ``rpa_harness = true`` turns it
on for every test here. Without an install, pytest would fail on the first unknown ``--rpa-*`` option; say
what to run instead.
"""

import pytest


def pytest_configure(config):
    if not config.pluginmanager.has_plugin("rpa-harness"):
        raise pytest.UsageError(
            "rpa-harness is not installed in this Python environment (its pytest plugin provides the options "
            "and fixtures these tests use); run: pip install -e '.[dev]'"
        )
