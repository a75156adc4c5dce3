"""One process owns the chip; the host's other processes send it their kernel calls.

A TPU is opened by one process (libtpu's lockfile), and a kernel call is a small part of an example: the
draw, the case's arrays, the float64 oracle and the comparison run on the host. So a run on a chip has one
**owner** process that holds the chip and makes the kernel calls (the known-good call first, then each
call under the watchdog, its output transferred back), and any number of host processes (pytest-xdist
workers) that draw, build arrays, compute oracles and judge in parallel, each sending its calls to the owner
over a unix socket (``Backend.run`` does it where the run installed the owner as the route of its calls,
``route_calls_to``). The owner takes requests from all of them at once, one thread a connection; calls reach
the chip one at a time, so every halt has one call to blame, while the next requests are already received
and unpickled.

A call that halts the chip, hangs or runs too slow ends the owner as it would end any process that holds
the chip (``endings``); first the owner tells the process whose call it was (with the calls that ran on the
chip just before it), and that process ends as it would have with the chip in hand: its halt or hang repro
written, its exit status. A ``Supervisor`` starts a fresh owner at the same address, and the other processes
send their calls there. Hypothesis shrinks in the worker as ever: each call of a shrink is a request.

On a host with several chips (a v5e-4 or -8, a v6e-8) a run can have one owner per chip (``Owners``): each
owner's libtpu is told to open one chip (``chip_pinning``) and each worker sends its calls to one owner,
worker i to owner i mod N (``address``). Each owner has a supervisor of its own, so a halt ends one chip's
owner and a fresh one opens that chip while the others serve on.

With ``--rpa-chip-owner=on`` an owner serves the interpreters too: the fast interpreter in one process
stands in for the chip on a CPU host (what the tests check); there the pinning is inert.
"""

import collections
import concurrent.futures
import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

import jax

from rpa_harness import generations
from rpa_harness.device import backends, chip, compilation, endings, processes

# The owner's socket, in the processes whose kernel calls it makes; where a run has an owner per chip, their
# sockets joined by os.pathsep, of which each xdist worker takes one (``address``).
ADDRESS_ENV = "RPA_CHIP_OWNER_SOCKET"
OWNER_MODULE = "rpa_harness.device.owner"  # run as ``python -m OWNER_MODULE SOCKET_PATH``: an owner process
OWNER_FILE = "owner.sock"
ENDED_FILE = "ended.json"  # the supervisor's last word, where it starts no more owners
STATS_FILE = "stats-{pid}.json"  # each owner's counts, rewritten after every call
START_SECONDS = 600.0  # how long a process waits for an owner to accept (an owner opening a chip: 8-15 s)
STARTS_BEFORE_GIVING_UP = 3  # owners in a row that end before serving a call
# Calls that ran on the chip just before a call that halts it, named in the halt's repro (a kernel can leave
# a DMA running after its call returns; its fault then surfaces in a later call, maybe another process's).
CALLS_KEPT = 2
ENDINGS = ("halted", "hung", "slow")  # the answers of a call that ended the owner
# Threads that compile signatures ahead of their calls: tracing and lowering hold the GIL, the compiler
# does not, so a second thread compiles while the first lowers.
COMPILE_THREADS = 2


class OwnerUnavailable(RuntimeError):
    """No owner accepted this process's call: the message says why (the supervisor's last word)."""


class CallEndedTheOwner(RuntimeError):
    """Raised, where ``endings_raise`` is in force, for a call that ended the owner: ``kind`` is halted,
    hung, slow or crashed; ``report`` what the owner said (for a halt: what, the error's first line)."""

    def __init__(self, kind: str, report: tuple):
        super().__init__(f"the call {kind}: {report[0] if report else 'the owner ended without a word'}")
        self.kind, self.report = kind, report


_endings_raise = False


@contextlib.contextmanager
def endings_raise():
    """Within the block, a call that ends the owner raises ``CallEndedTheOwner`` in this process instead of
    ending it too: for a tool that goes on after a halt (``rpa-harness chip agreement``), not for a property,
    whose process ends with its repro."""
    global _endings_raise
    previous, _endings_raise = _endings_raise, True
    try:
        yield
    finally:
        _endings_raise = previous


# ---------------------------------------------------------------------------------------------------------
# What a request carries.


def _raised(error: BaseException) -> tuple:
    """The answer for a call that raised: the exception where it pickles, else its class's module and name
    and its message, what the checks read of it (``stand_in`` rebuilds it)."""
    try:
        pickle.loads(pickle.dumps(error))
        return ("raised", error)
    except Exception:
        return ("raised-as", type(error).__module__, type(error).__name__, str(error))


def stand_in(module: str, name: str, message: str) -> Exception:
    """An exception of a class named as the owner's was, carrying its message."""
    return type(name, (Exception,), {"__module__": module})(message)


# The example in flight in this process (``recording`` sets it): sent with each call, so that the owner
# can name it among the calls that ran before a halt.
_example_in_flight: dict | None = None
# Set from the owner's report of a halt: the examples whose calls ran on the chip just before it.
_calls_before_the_halt: list | None = None


def set_example_in_flight(example: dict | None) -> None:
    global _example_in_flight
    _example_in_flight = example


def calls_before_the_halt() -> list | None:
    """The examples the owner ran just before the call that halted the chip (any process's), or None where
    this process holds the chip itself."""
    return _calls_before_the_halt


# ---------------------------------------------------------------------------------------------------------
# The processes that send calls.


def worker_number() -> int:
    """This process's number among pytest-xdist's workers (gw3: 3), which xdist sets in a worker's
    environment before its configuration; 0 in any other process."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0


def address() -> str | None:
    """The owner this process sends its calls to: the one ``ADDRESS_ENV`` names, or of the several it names
    (one owner per chip) the one this worker's number picks, worker i taking owner i mod N, so that the
    workers spread evenly over the chips (a replacement worker's new number picks one as well)."""
    addresses = [where for where in os.environ.get(ADDRESS_ENV, "").split(os.pathsep) if where]
    return addresses[worker_number() % len(addresses)] if addresses else None


def route_calls_to(where: str | None) -> None:
    """Makes the owner at ``where`` this process's route for kernel calls (``backends.route_calls``), and
    of the processes it starts (``ADDRESS_ENV``); None: calls are made here again."""
    if where is None:
        os.environ.pop(ADDRESS_ENV, None)
        backends.route_calls(None)
    else:
        os.environ[ADDRESS_ENV] = where
        backends.route_calls(call)


@contextlib.contextmanager
def calls_routed_to(where: str):
    """``route_calls_to(where)`` for the enclosed block."""
    previous = os.environ.get(ADDRESS_ENV) or None
    route_calls_to(where)
    try:
        yield
    finally:
        route_calls_to(previous)


_connection: Connection | None = None
_connection_lock = threading.Lock()


def _connect(where: str) -> Connection:
    """A connection to the owner at ``where``, waiting for one to accept (a fresh owner is opening the chip);
    ``OwnerUnavailable`` where the supervisor has given up or none accepts in ``START_SECONDS``."""
    deadline = time.monotonic() + START_SECONDS
    ended = Path(where).parent / ENDED_FILE
    while True:
        if ended.exists():
            raise OwnerUnavailable(json.loads(ended.read_text())["reason"])
        try:
            return Client(where, family="AF_UNIX")
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise OwnerUnavailable(
                    f"no chip owner accepted a call at {where} within {START_SECONDS:g} s"
                ) from None
            time.sleep(0.05)


def _drop_connection() -> None:
    global _connection
    if _connection is not None:
        _connection.close()
    _connection = None


def call(backend, fn, args: tuple, kwargs: dict):
    """``backend.run(fn, *args, **kwargs)`` made by the owner: its output, or what it raised. A call that
    halts the chip, hangs or is too slow ends this process as it would with the chip in hand; a call the
    owner had not started when it ended (another process's call halted the chip) goes to the next owner."""
    where = address()
    assert where is not None
    request = ("call", backend, fn, args, kwargs, _example_in_flight)
    try:
        payload = pickle.dumps(request)
    except Exception as error:
        raise TypeError(
            f"a kernel call for the chip's owner process must pickle ({type(error).__name__}: {error}); pass "
            "a module-level function or a target's method"
        ) from None
    what = f"a kernel call on {backend.name} (in the chip's owner process)"
    with _connection_lock:
        answer = None
        while answer is None:  # None: the owner ended before it started this call
            answer = _exchange(where, payload, what)
    kind, rest = answer
    if kind == "returned":
        return rest[0]
    if kind == "raised":
        raise rest[0]
    if kind == "raised-as":
        raise stand_in(*rest)
    _end_as_the_owner_did(kind, rest)


def _exchange(where: str, payload: bytes, what: str) -> tuple[str, list] | None:
    """Sends a call and waits for its answer: (kind, the rest of it); "crashed" where the owner ended during
    the call without one; None where it ended before starting it (the call goes to the next owner)."""
    global _connection
    if _connection is None:
        _connection = _connect(where)
    started = False
    try:
        _connection.send_bytes(payload)
        while True:
            kind, *rest = _connection.recv()
            if kind != "started":
                if kind in ENDINGS:
                    _drop_connection()
                return kind, rest
            started = True
    except (EOFError, OSError):
        _drop_connection()
        return (
            ("crashed", [what, "the owner process ended during the call without a word"]) if started else None
        )


def _end_as_the_owner_did(kind: str, report: list | tuple):
    """A call that ended the owner ends this process the same way (its handlers write the case's repro),
    or raises ``CallEndedTheOwner`` within ``endings_raise``."""
    global _calls_before_the_halt
    if _endings_raise:
        raise CallEndedTheOwner(kind, tuple(report))
    if kind == "hung":
        endings.end_on_hang(report[0], report[1], stacks=False)
    elif kind == "slow":
        endings.end_too_slow(*report)
    if kind == "halted":
        _calls_before_the_halt = report[2]
    endings.end_on_halt(report[0], report[1])


def owner_facts(where: str) -> dict:
    """What the owner at ``where`` runs on: its platform, and the chips it holds (``chip.Tpus``)."""
    connection = _connect(where)
    try:
        connection.send_bytes(pickle.dumps(("facts",)))
        return connection.recv()
    finally:
        connection.close()


# ---------------------------------------------------------------------------------------------------------
# The owner.


class Owner:
    """The process that makes every kernel call: ``serve`` until the supervisor ends it."""

    def __init__(self, where: str):
        self.where = where
        self.chip = threading.Lock()  # one call on the chip at a time
        self.recent: collections.deque = collections.deque(maxlen=CALLS_KEPT)
        self.started = time.monotonic()
        self.calls = 0
        self.busy = 0.0
        self.began = 0.0  # when the call in flight started
        self.stats_path = Path(where).parent / STATS_FILE.format(pid=os.getpid())
        self.seconds: collections.defaultdict = collections.defaultdict(float)  # where the owner's time went
        self.signatures: dict[tuple, dict] = {}  # a call's static signature -> its calls and compilations
        self.compiling: dict[tuple, concurrent.futures.Future] = {}
        self.compilers = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="compile")
        self.stats_lock = threading.Lock()
        self.last_compiled = 0.0  # when (time.time()) a signature last finished compiling

    def serve(self) -> None:
        with endings.on_hang(None), endings.on_halt(None):
            chip.check_the_chip_once()  # a faulted chip ends the owner before it accepts a call
        self.write_stats()
        listener = Listener(self.where, family="AF_UNIX")
        while True:
            connection = listener.accept()
            threading.Thread(target=self.serve_connection, args=(connection,), daemon=True).start()

    def serve_connection(self, connection: Connection) -> None:
        try:
            while True:
                payload = connection.recv_bytes()
                received = time.perf_counter()
                request = pickle.loads(payload)
                self.add_seconds(receive_s=time.perf_counter() - received)
                if request[0] == "facts":
                    connection.send(self.facts())
                else:
                    answer = self.run(connection, *request[1:])
                    replying = time.perf_counter()
                    connection.send(answer)
                    self.add_seconds(reply_s=time.perf_counter() - replying)
        except (EOFError, OSError):
            connection.close()

    def add_seconds(self, **seconds: float) -> None:
        with self.stats_lock:
            for name, value in seconds.items():
                self.seconds[name] += value

    def facts(self) -> dict:
        tpus = chip.tpus()
        return {"platform": jax.devices()[0].platform, "tpu_kind": tpus.kind, "tpu_count": tpus.count}

    def run(self, connection: Connection, backend, fn, args, kwargs, example) -> tuple:
        signature = self.compile_ahead(backend, fn, args, kwargs)
        waiting = time.perf_counter()
        with self.chip:
            connection.send(("started",))
            self.began = time.perf_counter()
            self.add_seconds(lock_wait_s=self.began - waiting)
            handlers = (
                endings.on_halt(
                    lambda what, error: self.ends(connection, "halted", what, error, list(self.recent))
                ),
                endings.on_hang(lambda what, seconds: self.ends(connection, "hung", what, seconds)),
                endings.on_slow(lambda message: self.ends(connection, "slow", message)),
            )
            try:
                with handlers[0], handlers[1], handlers[2], compilation.metered() as compiled:
                    answer: tuple = ("returned", backend.run(fn, *args, **kwargs))
            except Exception as error:
                answer = _raised(error)
            self.count_the_call(signature, compiled)
            if example is not None:
                self.recent.append(example)
            return answer

    def compile_ahead(self, backend, fn, args, kwargs) -> tuple | None:
        """For a target's call (``Target.attention``), its static signature, compiled before the call takes
        the chip: the first call of a signature has a compiler thread trace, lower and compile it
        (``Target.precompile``) while the chip runs other calls, and every call of that signature waits for
        it here, outside the chip's lock. None for any other call (it compiles, if at all, in its call)."""
        target = getattr(fn, "__self__", None)
        if target is None or getattr(fn, "__name__", None) != "attention" or kwargs:
            return None
        if not hasattr(target, "precompile"):
            return None
        signature = target.signature(*args)
        if backend.generation != generations.NONE:
            # An interpreter's emulated generation is the process's (its device kind, registered while a
            # call traces): a call emulating another generation must not trace meanwhile.
            return signature
        with self.stats_lock:
            future = self.compiling.get(signature)
            if future is None:
                future = self.compiling[signature] = self.compilers.submit(
                    self.precompile, backend, target, args, signature
                )
        started = time.perf_counter()
        try:
            future.result(timeout=endings.CALL_TIMEOUT_SECONDS)
        except concurrent.futures.TimeoutError:
            pass  # the call compiles what is left under the chip's watchdog
        self.add_seconds(compile_wait_s=time.perf_counter() - started)
        return signature

    def precompile(self, backend, target, args, signature: tuple) -> None:
        """One signature's compilation, on a compiler thread: what it cost is the signature's; an error is
        left for the call, which raises it as its own (a refusal, an invalid case)."""
        with compilation.metered() as compiled:
            try:
                with backend.context():
                    ahead = target.precompile(*args)
            except Exception:
                ahead = False
        with self.stats_lock:
            self.last_compiled = time.time() if compiled.seconds else self.last_compiled
            self.seconds["compile_ahead_s"] += compiled.seconds
            self.signature_stats(signature).update(ahead=ahead, ahead_s=compiled.seconds)

    def signature_stats(self, signature: tuple) -> dict:
        return self.signatures.setdefault(
            signature, {"calls": 0, "ahead": False, "ahead_s": 0.0, "in_call_s": 0.0, "compiled_in_calls": 0}
        )

    def count_the_call(self, signature: tuple | None = None, compiled=None) -> None:
        in_lock = time.perf_counter() - self.began
        compile_s = compiled.seconds if compiled is not None else 0.0
        with self.stats_lock:
            self.calls += 1
            self.busy += in_lock
            self.seconds["compile_in_call_s"] += compile_s
            self.seconds["run_s"] += in_lock - compile_s
            if compile_s:
                self.last_compiled = time.time()
            if signature is not None:
                stats = self.signature_stats(signature)
                stats["calls"] += 1
                stats["in_call_s"] += compile_s
                stats["compiled_in_calls"] += bool(compiled and compiled["executables"])
        self.write_stats()

    def ends(self, connection: Connection, kind: str, *report) -> tuple[str, int]:
        """Tells the caller how its call ended this owner; the owner's own message and exit status."""
        self.count_the_call()
        codes = {
            "halted": endings.HALT_EXIT_CODE,
            "hung": endings.HANG_EXIT_CODE,
            "slow": endings.SLOW_EXIT_CODE,
        }
        if kind != "slow":  # (what, ...): the caller's message names the owner as where the call ran
            report = (f"{report[0]} (in the chip's owner process)", *report[1:])
        try:
            connection.send((kind, *report))
        except OSError:
            pass
        return f"rpa-harness chip owner: the call in flight {kind}: {report[0]}", codes[kind]

    def write_stats(self) -> None:
        with self.stats_lock:
            stats = {
                "pid": os.getpid(),
                "calls": self.calls,
                "busy_s": self.busy,
                "alive_s": time.monotonic() - self.started,
                "seconds": dict(self.seconds),
                "last_compiled": self.last_compiled,
                "signatures": list(self.signatures.values()),
            }
        written = self.stats_path.with_suffix(".tmp")
        written.write_text(json.dumps(stats))
        written.replace(self.stats_path)  # a reader never sees half a file


# ---------------------------------------------------------------------------------------------------------
# The supervisor, in the process that starts the workers.


class Supervisor:
    """Keeps an owner serving at one address for a run: starts one, and a fresh one whenever it ends,
    until ``stop``; gives up (``ENDED_FILE``) after ``STARTS_BEFORE_GIVING_UP`` owners in a row that ended
    before serving a call."""

    def __init__(self, environ: dict, log_path: Path | None = None):
        self.folder = Path(tempfile.mkdtemp(prefix="rpa-chip-owner-"))
        self.where = str(self.folder / OWNER_FILE)
        self.environ = {key: value for key, value in environ.items() if key != ADDRESS_ENV}
        self.environ["PYTHONPATH"] = os.pathsep.join(entry for entry in sys.path if entry)
        self.log_path = log_path or self.folder / "owner.log"
        self.exits: list[int] = []
        self.stopping = threading.Event()
        self.process: subprocess.Popen | None = None
        self.watcher = threading.Thread(
            target=self.keep_one_serving, name="rpa-harness chip owner", daemon=True
        )

    def start(self) -> "Supervisor":
        self.watcher.start()
        return self

    def spawn(self) -> subprocess.Popen:
        Path(self.where).unlink(missing_ok=True)
        with open(self.log_path, "a") as log:
            return processes.start(
                processes.python("-m", OWNER_MODULE, self.where),
                env=self.environ, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def keep_one_serving(self) -> None:
        unserved = 0
        while not self.stopping.is_set():
            self.process = self.spawn()
            if self.stopping.is_set():  # stopped while this one started: ``stop`` may have missed it
                processes.end(self.process)
                return
            code = self.process.wait()
            if self.stopping.is_set():
                return
            self.exits.append(code)
            served = sum(stats["calls"] for stats in self.owner_stats() if stats["pid"] == self.process.pid)
            unserved = 0 if served else unserved + 1
            if unserved >= STARTS_BEFORE_GIVING_UP:
                reason = (
                    f"{unserved} chip owners in a row ended before serving a call (last exit status {code}); "
                    f"see {self.log_path}"
                )
                (self.folder / ENDED_FILE).write_text(json.dumps({"reason": reason}))
                return

    def owner_stats(self) -> list[dict]:
        found = []
        for path in self.folder.glob(STATS_FILE.format(pid="*")):
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return found

    def summary(self) -> dict:
        """The owners this supervisor started, together (``summary_of``)."""
        return summary_of(self.owner_stats(), self.exits)

    def stop(self) -> dict:
        """Ends the owner (its own process group: nothing else) and returns ``summary``."""
        self.stopping.set()
        if self.process is not None:
            processes.end(self.process)
        self.watcher.join(timeout=60)
        summary = self.summary()
        for path in self.folder.iterdir():
            if path != self.log_path:
                path.unlink(missing_ok=True)
        return summary


def summary_of(stats: list[dict], exits: list[int]) -> dict:
    """Owner processes together, from their ``STATS_FILE``s: calls made, seconds the chip was busy, seconds
    owners were up, owners started, the exit statuses of those that ended before the run did, where the
    calls' seconds went and what was compiled."""
    seconds: collections.defaultdict = collections.defaultdict(float)
    for owner in stats:
        for name, value in owner.get("seconds", {}).items():
            seconds[name] += value
    signatures = [signature for owner in stats for signature in owner.get("signatures", [])]
    return {
        "calls": sum(s["calls"] for s in stats),
        "busy_s": sum(s["busy_s"] for s in stats),
        "alive_s": sum(s["alive_s"] for s in stats),
        "owners": len(stats),
        "exits": list(exits),
        "seconds": dict(seconds),
        "last_compiled": max((s.get("last_compiled", 0.0) for s in stats), default=0.0),
        "signatures": len(signatures),
        "compiled_ahead": sum(1 for s in signatures if s["ahead"]),
        "signatures_compiled_in_calls": sum(1 for s in signatures if s["compiled_in_calls"]),
        "calls_per_signature": sorted(s["calls"] for s in signatures),
    }


# libtpu's environment for a process that opens some of its host's chips, as tpu-inference 0.32.0 sets it for
# a data-parallel rank (tpu_inference/worker/tpu_worker.py, ``_setup_dp_chip_isolation``) and jax's Cloud TPU
# recipe for non-communicating processes (gist skye/f82ba45d2445bb19d53545538754f9a3): the chips it sees
# (TPU_VISIBLE_CHIPS), their shape (TPU_CHIPS_PER_PROCESS_BOUNDS), one process in its own slice
# (TPU_PROCESS_BOUNDS, CLOUD_TPU_TASK_ID), and a libtpu port of its own so that the runtimes coexist on the
# host (TPU_PROCESS_PORT, TPU_PROCESS_ADDRESSES), numbered from libtpu's default 8476 as tpu-inference does.
# Chip bounds smaller than a host's also spare the owners libtpu's host-wide lockfile, which would let one of
# them open a chip (XLA's tpu_initializer_helper.cc, ``TryAcquireTpuLock``: bounds set and not the whole
# host's, "allowing multiple libtpu.so loads").
TPU_PROCESS_PORT_BASE = 8476


def chip_pinning(chip: int, chips: int) -> dict[str, str]:
    """The environment in which owner ``chip`` of ``chips`` opens that one chip of its host and no other
    (libtpu opens every chip of the host unless told which); none for a single owner, which opens them all
    as a process without owners would."""
    if chips == 1:
        return {}
    port = TPU_PROCESS_PORT_BASE + chip
    return {
        "TPU_VISIBLE_CHIPS": str(chip),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": "1,1,1",
        "CLOUD_TPU_TASK_ID": "0",
        "TPU_PROCESS_PORT": str(port),
        "TPU_PROCESS_ADDRESSES": f"localhost:{port}",
    }


class Owners:
    """A run's owners, one per chip, each kept serving by a ``Supervisor`` of its own: a halt ends the owner
    of one chip, and a fresh one opens that chip while the others serve on. ``where`` is their addresses as
    ``ADDRESS_ENV`` carries them to the workers."""

    def __init__(self, environ: dict, chips: int):
        self.supervisors = [Supervisor({**environ, **chip_pinning(chip, chips)}) for chip in range(chips)]
        self.where = os.pathsep.join(supervisor.where for supervisor in self.supervisors)

    def start(self) -> "Owners":
        for supervisor in self.supervisors:
            supervisor.start()
        return self

    def facts(self) -> list[dict]:
        """``owner_facts`` of each owner, once it has opened its chip (they open them at once)."""
        return [owner_facts(supervisor.where) for supervisor in self.supervisors]

    def summary(self) -> dict:
        """The owners together (``summary_of``), and each chip's: ``per_chip``, the chip (its
        TPU_VISIBLE_CHIPS; all, for a single owner), its calls, busy seconds, owner processes and early
        exits, in chip order."""
        stats = [supervisor.owner_stats() for supervisor in self.supervisors]  # each read once
        together = summary_of(
            [owner for each in stats for owner in each],
            [code for supervisor in self.supervisors for code in supervisor.exits],
        )
        together["per_chip"] = []
        for supervisor, each in zip(self.supervisors, stats, strict=True):
            chip = summary_of(each, supervisor.exits)
            together["per_chip"].append(
                {
                    "chip": supervisor.environ.get("TPU_VISIBLE_CHIPS", "all"),
                    **{name: chip[name] for name in ("calls", "busy_s", "owners", "exits")},
                }
            )
        return together

    def stop(self) -> dict:
        """Ends every owner (``Supervisor.stop``) and returns ``summary`` as it stood before."""
        summary = self.summary()
        for supervisor in self.supervisors:
            supervisor.stop()
        return summary


def summary_lines(summary: dict) -> list[str]:
    """``Supervisor.summary`` in words: the signatures compiled (ahead of their calls, off the chip's path,
    or in them, on it) and the calls each served; where a call's seconds went."""
    calls, seconds = summary["calls"], summary["seconds"]
    if not calls:
        return []
    served = summary["calls_per_signature"]
    lines = []
    if served:
        lines.append(
            f"{summary['signatures']} static signatures, {summary['compiled_ahead']} compiled ahead of their "
            f"calls ({seconds.get('compile_ahead_s', 0.0):.1f} s, off the chip's path), "
            f"{summary['signatures_compiled_in_calls']} compiling in their calls "
            f"({seconds.get('compile_in_call_s', 0.0):.1f} s, on it); calls per signature {served[0]} to "
            f"{served[-1]} (median {served[len(served) // 2]})"
        )
    per_call = ", ".join(
        f"{seconds.get(name, 0.0) / calls * 1e3:.1f} ms {words}"
        for name, words in (
            ("receive_s", "receiving"),
            ("compile_wait_s", "waiting for its compilation"),
            ("lock_wait_s", "waiting for the chip"),
            ("run_s", "running (transfers, dispatch, the chip)"),
            ("reply_s", "replying"),
        )
    )
    lines.append(f"per call: {per_call}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write(f"usage: python -m {OWNER_MODULE} SOCKET_PATH\n")
        return 4
    compilation.count_compilations()
    cache = compilation.compilation_cache_setting(None)
    if cache is not None:
        compilation.enable_compilation_cache(cache)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    Owner(argv[0]).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
