"""A child the harness starts runs in a session of its own, and ending it ends what it started."""

import os
import signal
import subprocess
import time

from rpa_harness.device import processes
from tests.processes import running

# A child that starts a grandchild in its session, prints the grandchild's pid, and waits.
PARENT_OF_A_SLEEPER = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(300)\n"
)


def test_run_returns_the_exit_code_and_the_output():
    done = processes.run(
        processes.python("-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)")
    )
    assert (done.returncode, done.stdout, done.stderr, done.timed_out) == (3, "out\n", "err\n", False)


def test_a_child_runs_in_a_session_of_its_own():
    done = processes.run(processes.python("-c", "import os; print(os.getsid(0), os.getpid())"))
    session, pid = done.stdout.split()
    assert session == pid != str(os.getsid(0))


def test_a_child_past_its_time_is_ended_with_what_it_started(tmp_path):
    log = tmp_path / "out"
    with open(log, "w") as output:
        done = processes.run(processes.python("-c", PARENT_OF_A_SLEEPER), timeout=3, output=output, grace=2)
    assert done.timed_out and done.returncode is None
    grandchild = int(log.read_text().split()[0])
    deadline = time.monotonic() + 5
    while running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(grandchild)


def test_end_sends_the_first_signal_to_the_child_alone():
    process = processes.start(
        processes.python("-c", "import signal, sys, time\n"
                         "signal.signal(signal.SIGINT, lambda *_: (print('interrupted', flush=True), sys.exit(5)))\n"
                         "print('ready', flush=True); time.sleep(300)"),
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout.readline() == "ready\n"
    processes.end(process, first=signal.SIGINT, grace=5)
    assert process.returncode == 5 and process.stdout.read() == "interrupted\n"


def test_run_passes_the_output_through_where_asked(capfd):
    done = processes.run(processes.python("-c", "print('passed through')"), output=processes.INHERIT)
    assert done.returncode == 0 and done.stdout == "" and "passed through" in capfd.readouterr().out


def leads_its_own_session(_) -> bool:
    return os.getsid(0) == os.getpid()


def test_a_worker_pools_workers_each_lead_a_session_of_their_own():
    with processes.worker_pool(2) as pool:
        assert all(pool.map(leads_its_own_session, range(4)))
