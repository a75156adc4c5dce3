"""Python child processes for the end-to-end tests, without paying the interpreter's imports each time.

``run_python(*args)`` is ``subprocess.run([sys.executable, *args], capture_output=True, text=True)``. A
``-m``/``-c`` program runs in a child forked by this process's zygote (``tests/zygote.py``), which has
imported jax, NumPy, Hypothesis and pytest once (~2.5 s less per program), unless its environment differs
from the one those imports saw in a variable that is not only read at run time (``RUN_TIME_VARIABLES``), or
its PYTHONPATH has a relative entry: that program, and every test about what an interpreter imports or
reads as it starts, gets a new one.
"""

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ZYGOTE = Path(__file__).with_name("zygote.py")

# Read by the programs when they run, never by the modules the zygote imported as they loaded: a child
# may set these (prefixes). Hypothesis reads HYPOTHESIS_NO_PLUGINS as it loads, so only these two of its own;
# libtpu reads its own when a program first asks it for a TPU or a topology (rpa_harness.ahead_of_time sets
# two in the process that compiles).
RUN_TIME_VARIABLES = (
    "RPA_", "PYTEST_", "HYPOTHESIS_PROFILE", "HYPOTHESIS_STORAGE_DIRECTORY", "TPU_", "ALLOW_MULTIPLE_LIBTPU_LOAD",
)  # fmt: skip


class _Zygote:
    def __init__(self):
        self.started_with = dict(os.environ)
        requests_read, self.requests = os.pipe()
        self.replies, replies_write = os.pipe()
        self.folder = tempfile.TemporaryDirectory(prefix="rpa-zygote-")  # no pytest configuration there
        self.process = subprocess.Popen(
            [sys.executable, str(ZYGOTE), str(requests_read), str(replies_write)],
            pass_fds=(requests_read, replies_write), stdin=subprocess.DEVNULL, cwd=self.folder.name,
        )  # fmt: skip
        os.close(requests_read)
        os.close(replies_write)
        self.pending = b""
        self.after_imports = self.reply(None)["environment"]  # they set a few variables themselves
        atexit.register(self.close)

    def close(self):
        """End of requests: the zygote exits; waited for, so that its CPU time counts as this process's."""
        os.close(self.requests)
        self.process.wait(timeout=60)
        self.folder.cleanup()

    def saw_the_same(self, env: dict) -> bool:
        """Whether the preloaded modules would have seen ``env`` as they did: every variable read at start
        the one the zygote started with or the one its imports left."""
        return all(
            env.get(name) in (self.started_with.get(name), self.after_imports.get(name))
            for name in env.keys() | self.started_with.keys() | self.after_imports.keys()
            if not name.startswith(RUN_TIME_VARIABLES)
        )

    def reply(self, timeout: float | None) -> dict | None:
        """The zygote's next reply, or None if none came within ``timeout`` seconds."""
        while b"\n" not in self.pending:
            if not select.select([self.replies], [], [], timeout)[0]:
                return None
            chunk = os.read(self.replies, 4096)
            if not chunk:
                raise RuntimeError(f"tests/zygote.py exited ({self.process.wait()}); its errors are above")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv, cwd, env, timeout):
        with tempfile.TemporaryDirectory(prefix="rpa-child-") as scratch:
            stdout, stderr = Path(scratch, "stdout"), Path(scratch, "stderr")
            request = {
                "argv": list(argv),
                "cwd": str(cwd),
                "env": env,
                "stdout": str(stdout),
                "stderr": str(stderr),
            }
            os.write(self.requests, (json.dumps(request) + "\n").encode())
            pid = self.reply(None)["pid"]
            finished = self.reply(timeout)
            if finished is None:
                os.kill(pid, signal.SIGKILL)
                self.reply(None)
            output = [path.read_text(errors="replace") for path in (stdout, stderr)]
        command = [sys.executable, *argv]
        if finished is None:
            raise subprocess.TimeoutExpired(command, timeout, *output)
        return subprocess.CompletedProcess(command, finished["returncode"], *output)


def names_the_same_folders_from_anywhere(python_path: str | None) -> bool:
    """Whether a PYTHONPATH means the same folders whatever the working directory: an interpreter resolves a
    relative (or empty) entry against the folder it starts in, and the zygote started in a folder of its own."""
    return not python_path or all(os.path.isabs(entry) for entry in python_path.split(os.pathsep))


_zygote: _Zygote | None = None


def run_python(*args: str, cwd, env=None, timeout: float = 900) -> subprocess.CompletedProcess:
    """``python *args`` in ``cwd`` with ``env`` (default: this process's), its output captured as text."""
    global _zygote
    env = dict(os.environ if env is None else env)
    forkable = args[0] in ("-m", "-c") and hasattr(os, "fork")
    if forkable and names_the_same_folders_from_anywhere(env.get("PYTHONPATH")):
        if _zygote is None or _zygote.process.poll() is not None:
            _zygote = _Zygote()
        if _zygote.saw_the_same(env):
            return _zygote.run(args, cwd, env, timeout)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


CHECKOUT_NAMES = ("harness", "kernel", "reference", "strategies", "spec")


def without_checkout_names(script: str) -> str:
    """``script`` with the checkout's folder names unimportable: what it imports must be installed (a user
    runs it outside any checkout)."""
    return f"import sys\nsys.modules.update(dict.fromkeys({CHECKOUT_NAMES!r}))\n{script}"


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a killed one not yet reaped is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
