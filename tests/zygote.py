"""A Python process that does the slow imports once, then forks one child per program it is asked to run.

Started by ``tests.processes`` as ``python tests/zygote.py REQUESTS_FD REPLIES_FD`` (JSON lines on two
pipes). A child runs its program as ``python -m module ...`` or ``python -c code ...`` would: its own
working directory, environment, ``sys.argv``, ``sys.path``, ``__main__``, standard streams to files, exit
status. It differs from a new interpreter only in the third-party modules below being imported already,
which costs a new interpreter ~2.5 s here; nothing of the harness is, so its state starts fresh in every child.
They are imported inside a pytest start-up, so that pytest's plugins (and the distributions they come
from, Hypothesis among them) are assertion-rewritten as in any pytest run, and a child's pytest finds them
imported by its own kind of loader instead of warning that it cannot rewrite them.
No thread of our own runs when it forks (importing jax starts none; NumPy's BLAS handles fork itself).
"""

import atexit
import builtins
import contextlib
import importlib
import io
import json
import os
import runpy
import sys
import threading
import traceback
import types

import pytest

PRELOADED = (
    "numpy",
    "ml_dtypes",
    "jax",
    "jax.numpy",
    "jax.experimental.pallas",
    "jax.experimental.pallas.tpu",
    "hypothesis",
    "hypothesis.extra.numpy",
    "_hypothesis_pytestplugin",
    "xdist.plugin",
    "pytest_timeout",
    "pygments",
)
OUR_PLUGIN = "rpa-harness"  # its entry point; never imported here
# Imported where it can be: jax 0.12's generic interpreter imports it, and the import sets
# MOSAIC_GPU_CUDA_ROOT, which a child then inherits (on jax 0.10 it needs absl, which is not installed).
PRELOADED_WHERE_PRESENT = ("jax.experimental.mosaic.gpu",)


def exit_status(code) -> int:
    """The interpreter's exit status for ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def run_program(argv, cwd, env, stdout, stderr, interpreter_path):
    """In the child: run ``argv`` (``["-m", module, *args]`` or ``["-c", code, *args]``); never returns."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    written = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, stdout, written), (2, stderr, written)):
        opened = os.open(path, flags, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    option, program, *args = argv
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    try:
        if option == "-m":
            sys.argv = [program, *args]  # runpy puts the module's file in argv[0]
            sys.path[:] = [os.getcwd(), *interpreter_path]
            runpy.run_module(program, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *args]
            sys.path[:] = ["", *interpreter_path]
            exec(compile(program, "<string>", "exec"), main.__dict__)
        status = 0
    except SystemExit as exit:
        status = exit_status(exit.code)
    except BaseException as error:  # as the interpreter shows it: from the program's first frame
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        status = 1
    # what the interpreter does on its way out: wait for non-daemon threads, then the atexit functions
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def serve(requests_fd: int, replies_fd: int, interpreter_path: list):
    """First the environment as the imports left it (some set variables); then one program at a time: fork,
    report the child's pid, wait, report its exit status as subprocess does."""
    with os.fdopen(requests_fd) as requests, os.fdopen(replies_fd, "w", buffering=1) as replies:
        replies.write(json.dumps({"environment": dict(os.environ)}) + "\n")
        for line in requests:
            pid = os.fork()
            if pid == 0:
                os.close(requests_fd)
                os.close(replies_fd)
                run_program(**json.loads(line), interpreter_path=interpreter_path)
            replies.write(json.dumps({"pid": pid}) + "\n")
            _, status = os.waitpid(pid, 0)
            replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")


class ImportWhilePytestStarts:
    """A pytest plugin that imports the modules once pytest has loaded its plugins and installed its
    assertion-rewriting import hook, before ``--version --version`` ends the run (a single ``--version``
    returns before pytest starts)."""

    @staticmethod
    @pytest.hookimpl(tryfirst=True)
    def pytest_cmdline_main(config):
        for name in PRELOADED:
            importlib.import_module(name)
        for name in PRELOADED_WHERE_PRESENT:
            try:
                importlib.import_module(name)
            except ImportError:
                pass


def preload():
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        status = pytest.main(["--version", "--version", "-p", f"no:{OUR_PLUGIN}", "-p", "no:cacheprovider"],
                             plugins=[ImportWhilePytestStarts()])  # fmt: skip
    if status != 0:
        raise SystemExit(
            f"tests/zygote.py: pytest --version --version exited {status} while importing {PRELOADED}"
        )


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder; a child puts its program's folder there, as the interpreter does
    interpreter_path = list(sys.path)
    preload()
    serve(int(sys.argv[1]), int(sys.argv[2]), interpreter_path)
