"""A pytest plugin (``-p tests.backends_witness``) that says, per process, whether jax initialised a backend.

At the end of its session each process writes ``RPA_WITNESS_DIR/<pid>.json``: whether it is an xdist
worker, whether jax initialised any backend (``xla_bridge.backends_are_initialized``, the same in jax 0.10
and 0.12), which, and the platforms jax was allowed (``jax_platforms``). A backend, once initialised, stays
for the life of the process, so the answer at the end covers the whole run.
"""

import json
import os
from pathlib import Path

import jax
from jax._src import xla_bridge

WITNESS_DIR_ENV = "RPA_WITNESS_DIR"


def pytest_unconfigure(config):
    folder = Path(os.environ[WITNESS_DIR_ENV])
    folder.mkdir(parents=True, exist_ok=True)
    seen = {
        "worker": hasattr(config, "workerinput"),
        "initialised": xla_bridge.backends_are_initialized(),
        "platforms": sorted(xla_bridge._backends),
        "allowed": jax.config.jax_platforms,
    }
    (folder / f"{os.getpid()}.json").write_text(json.dumps(seen))
