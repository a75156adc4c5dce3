"""Every child process the harness starts, started and ended one way.

A child runs in a POSIX session of its own, so that ending it ends whatever it started too (pytest's
workers, a chip owner, a compiler) and nothing outside it: the chip is opened by one process at a time, and
a process left holding it, or killed in the middle of a call, leaves a fault for the next one.

- ``start`` starts a child in its own session (a ``subprocess.Popen``);
- ``end`` ends one: an optional first signal to the child alone (SIGINT lets a pytest controller end its
  workers and write its summary), then SIGTERM to its session, then SIGKILL, each after a grace period;
- ``run`` starts a child, waits for it up to a time limit, ends it on the limit, and returns what it did
  (a ``Finished``: never an exception for a child that ran out of time);
- ``worker_pool`` starts Python workers for CPU work (``concurrent.futures``' process pool), each in a
  session of its own, all ended with the pool.
"""

import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

# ``start``'s stdout and stderr choices, as ``subprocess`` names them.
PIPE, STDOUT, DEVNULL = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL
GRACE_SECONDS = 30.0  # how long a signalled session has to end before the next, harder signal

# What ``run`` does with a child's output: keep it (``Finished.stdout``/``stderr``), drop it, or pass it
# through to this process's own stdout and stderr.
CAPTURE, DISCARD, INHERIT = "capture", "discard", "inherit"


def python(*args: str) -> list[str]:
    """A command running this Python: ``python("-m", "pytest", ...)``."""
    return [sys.executable, *args]


def start(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    stdin: Any = DEVNULL,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = True,
) -> subprocess.Popen:
    """Starts ``command`` in a session of its own; ``stdout``/``stderr`` are as ``subprocess.Popen`` takes
    them (a file, ``PIPE``, ``STDOUT``, ``DEVNULL``, or None for this process's own); so is ``stdin``."""
    streams = {"stdin": stdin, "stdout": stdout, "stderr": stderr}
    environ = None if env is None else dict(env)
    return subprocess.Popen(list(command), env=environ, cwd=cwd, text=text, start_new_session=True, **streams)


def end(process: subprocess.Popen, *, first: int | None = None, grace: float = GRACE_SECONDS) -> None:
    """Ends ``process`` and its session: ``first`` (a signal) to the child alone when given, then SIGTERM to
    the session, then SIGKILL, each given ``grace`` seconds; returns once the child is reaped."""
    for sig, whom in ((first, "child"), (signal.SIGTERM, "session"), (signal.SIGKILL, "session")):
        if process.poll() is not None:
            break
        if sig is None:
            continue
        try:
            if whom == "child":
                os.kill(process.pid, sig)
            else:
                os.killpg(process.pid, sig)
        except ProcessLookupError:  # it ended meanwhile
            break
        try:
            process.wait(timeout=None if sig == signal.SIGKILL else grace)
        except subprocess.TimeoutExpired:
            continue
    process.wait()
    _end_what_is_left(process.pid)


@contextlib.contextmanager
def worker_pool(count: int):
    """A pool of ``count`` spawned Python workers (each imports what its tasks need afresh), each in a
    session of its own; on leaving the block the pool waits for its tasks, or, where the block raised,
    cancels those not started and ends every worker's session."""
    context = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(count, mp_context=context, initializer=os.setsid)
    try:
        yield pool
    except BaseException:
        # The pool has no public way to end its workers (before Python 3.14's terminate_workers).
        workers = [process.pid for process in (pool._processes or {}).values() if process.pid is not None]
        pool.shutdown(wait=False, cancel_futures=True)
        for pid in workers:
            _end_what_is_left(pid)
        raise
    pool.shutdown(wait=True)


def _end_what_is_left(session: int) -> None:
    """Kills what the ended child's session still holds (a grandchild that outlived its parent)."""
    try:
        os.killpg(session, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclasses.dataclass(frozen=True)
class Finished:
    """What a child did: its exit code (None when it ran out of time and was ended), its output where kept,
    and how long it ran."""

    command: tuple[str, ...]
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run(
    command: Sequence[str],
    *,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    output: str | IO[str] = CAPTURE,
    first: int | None = None,
    grace: float = GRACE_SECONDS,
) -> Finished:
    """Runs ``command`` in its own session for at most ``timeout`` seconds, then ends it (``end``, with
    ``first`` and ``grace``). ``output`` is ``CAPTURE``, ``DISCARD``, ``INHERIT`` or an open file that takes
    stdout and stderr together."""
    if output == CAPTURE:
        streams: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    elif output == DISCARD:
        streams = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    elif output == INHERIT:
        streams = {"stdout": None, "stderr": None}
    else:
        streams = {"stdout": output, "stderr": subprocess.STDOUT}
    started = time.monotonic()
    process = start(command, env=env, cwd=cwd, **streams)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        returncode: int | None = process.returncode
    except subprocess.TimeoutExpired:
        end(process, first=first, grace=grace)
        stdout, stderr = process.communicate()
        returncode = None
    except BaseException:  # this process interrupted: its child goes with it
        end(process, first=first, grace=grace)
        raise
    _end_what_is_left(process.pid)
    return Finished(tuple(command), returncode, stdout or "", stderr or "", time.monotonic() - started)
