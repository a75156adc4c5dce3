"""``tests.processes.run_python``: a forked child runs a program as a new interpreter would."""

import json
import os
import subprocess
import sys

import pytest

from tests import processes
from tests.processes import names_the_same_folders_from_anywhere, run_python

SEEN = (
    "import json, os, sys\n"
    "print(json.dumps([sys.argv, sys.path, os.getcwd(), __name__, os.environ.get('RPA_PROBE'), sys.stdin.read()]))\n"
)


def new_interpreter(*args, cwd, env=None):
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_a_program_sees_what_a_new_interpreter_shows_it(tmp_path):
    (tmp_path / "probe.py").write_text(SEEN)
    env = dict(os.environ, RPA_PROBE="set for this run")
    for args in (("-c", SEEN, "an argument"), ("-m", "probe", "an argument")):
        warm, new = run_python(*args, cwd=tmp_path, env=env), new_interpreter(*args, cwd=tmp_path, env=env)
        assert (warm.returncode, warm.stderr) == (0, "") and json.loads(warm.stdout) == json.loads(new.stdout)


def test_a_relative_pythonpath_names_folders_of_the_programs_cwd(tmp_path, monkeypatch):
    """Also where the run (so its zygote) started with relative PYTHONPATH entries (here an empty one and
    ``probes``): the zygote resolved them in a folder of its own, an interpreter started for the program
    resolves them in the program's cwd."""
    monkeypatch.setenv("PYTHONPATH", f"{os.pathsep}probes")
    monkeypatch.setattr(processes, "_zygote", None)  # the next program starts a zygote in this environment
    (tmp_path / "probe.py").write_text(SEEN)
    for args in (("-c", SEEN), ("-m", "probe")):
        warm, new = run_python(*args, cwd=tmp_path), new_interpreter(*args, cwd=tmp_path)
        assert warm.returncode == 0 and json.loads(warm.stdout) == json.loads(new.stdout), warm.stderr


def test_jax_is_imported_in_advance_and_nothing_of_the_harness(tmp_path):
    """Unless this run's own PYTHONPATH is relative: then every program gets a new interpreter."""
    preloaded = run_python(
        "-c", "import sys; print('jax' in sys.modules, 'rpa_harness' in sys.modules)", cwd=tmp_path
    )
    forked = names_the_same_folders_from_anywhere(os.environ.get("PYTHONPATH"))
    assert preloaded.stdout.split() == [str(forked), "False"], preloaded.stdout + preloaded.stderr


@pytest.mark.parametrize(
    "program, returncode, stdout, stderr",
    [
        ("import sys; sys.exit(3)", 3, "", ""),
        ("import sys; sys.exit('no such file')", 1, "", "no such file\n"),
        ("import os; print('flushed?', flush=True); os._exit(70)", 70, "flushed?\n", ""),
        ("import atexit; atexit.register(print, 'at exit'); print('main')", 0, "main\nat exit\n", ""),
        ("import threading, time; threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()",
         0, "thread\n", ""),
    ],
)  # fmt: skip
def test_exit_status_and_output_are_the_interpreters(tmp_path, program, returncode, stdout, stderr):
    result = run_python("-c", program, cwd=tmp_path)
    assert (result.returncode, result.stdout, result.stderr) == (returncode, stdout, stderr)


def test_an_uncaught_exception_shows_the_programs_traceback(tmp_path):
    program = "def f():\n    raise ValueError('boom')\nf()"
    warm, new = run_python("-c", program, cwd=tmp_path), new_interpreter("-c", program, cwd=tmp_path)
    assert warm.returncode == new.returncode == 1 and warm.stderr == new.stderr, warm.stderr


def test_a_program_past_its_timeout_is_killed_and_the_next_one_runs(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_python("-c", "import time; time.sleep(60)", cwd=tmp_path, timeout=0.5)
    assert run_python("-c", "print('next')", cwd=tmp_path).stdout == "next\n"


def test_a_variable_read_as_the_interpreter_starts_gets_a_new_interpreter(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu,never-seen-before")
    result = run_python("-c", "import os, sys; print('jax' in sys.modules, os.environ['JAX_PLATFORMS'])", cwd=tmp_path,
                        env=env)  # fmt: skip
    assert result.stdout.split() == ["False", "cpu,never-seen-before"]
