"""xdist workers start with one BLAS thread each unless the user chose a count (``device.one_blas_thread_per_worker``)."""

import os
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    """
    import os

    def test_worker_environment():
        assert os.environ.get("PYTEST_XDIST_WORKER")
        raise AssertionError(f"threads {os.environ.get('OPENBLAS_NUM_THREADS')} {os.environ.get('MKL_NUM_THREADS')}")
    """
)


def worker_threads(tmp_path, **chosen) -> str:
    """What a test in an xdist worker sees, the run's own thread settings replaced by ``chosen``."""
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")} | chosen
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "test_probe.py", "-n", "2", "-p", "no:cacheprovider", "-q",
         "--rpa-backend=fast-interpret", f"--rpa-repro-dir={tmp_path / 'repros'}",
         f"--rpa-compilation-cache={tmp_path / 'cache'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


def test_xdist_workers_get_one_blas_thread_where_the_user_chose_no_count(tmp_path):
    """One run for both sides: OpenBLAS's count is the user's, MKL's (not chosen) is the plugin's one."""
    assert "AssertionError: threads 2 1" in worker_threads(tmp_path, OPENBLAS_NUM_THREADS="2")
