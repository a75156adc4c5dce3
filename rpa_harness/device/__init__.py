"""The one way to the device: where a kernel runs and how every call reaches it, and every child process.

The public front over the package's modules, each one job:

- ``backends``: the backends (the checking TPU interpreter, the fast interpreter, a real TPU), resolving a
  ``--rpa-backend`` choice, and ``Backend``, through which every kernel call is made;
- ``endings``: how a process ends on a hang, a call too slow to judge, a halted device or a chip faulted
  before its first example, the exit codes, and the watchdog;
- ``chip``: whether a TPU is present (the probe), how many chips the host has, and the known-good call
  before a process's first call;
- ``compilation``: jax's compilation cache, the CPU compiler's flags, and counting compilations;
- ``interpreter_reports``: the checking interpreter's races, deadlocks and exits that would halt a TPU;
- ``owner``: the chip owner, the one process that makes a run's kernel calls, installed as the route of
  the others' calls;
- ``processes``: every child process, started in a session of its own and ended by its id.
"""

from rpa_harness.device import backends, chip, compilation, endings, interpreter_reports, owner, processes
from rpa_harness.device.backends import (
    AUTO,
    BACKENDS,
    FAST_INTERPRET,
    INTERPRET,
    TPU,
    TPU_COMPILER,
    Backend,
    BackendChoiceError,
    resolve,
)
from rpa_harness.device.chip import (
    TPU_PROBE_ENV,
    Tpus,
    chip_in_words,
    chips_on_this_host,
    keep_off_the_chips,
    tpus,
)
from rpa_harness.device.compilation import (
    COMPILATION_CACHE_ENV,
    DEFAULT_COMPILATION_CACHE,
    FASTER_CPU_COMPILATION,
    compilation_cache_setting,
    compilation_stats,
    count_compilations,
    enable_compilation_cache,
    faster_cpu_compilation,
    metered,
    one_blas_thread_per_worker,
)
from rpa_harness.device.endings import (
    CHIP_FAULTED,
    CHIP_FAULTED_EXIT_CODE,
    HALT_EXIT_CODE,
    HALT_MESSAGES,
    HANG_EXIT_CODE,
    SLOW_EXIT_CODE,
    call_timeout,
    end_on_halt,
    on_halt,
    on_hang,
    set_output_release,
    watchdog,
)
from rpa_harness.device.interpreter_reports import (
    CHECKING_INTERPRET_PARAMS,
    WOULD_HALT_A_TPU,
    Deadlock,
    RaceDetected,
    WouldHaltTpu,
)

__all__ = [
    # the modules
    "backends", "chip", "compilation", "endings", "interpreter_reports", "owner", "processes",
    # backends
    "AUTO", "BACKENDS", "FAST_INTERPRET", "INTERPRET", "TPU", "TPU_COMPILER", "Backend", "BackendChoiceError",
    "resolve",
    # chip
    "TPU_PROBE_ENV", "Tpus", "chip_in_words", "chips_on_this_host", "keep_off_the_chips", "tpus",
    # compilation
    "COMPILATION_CACHE_ENV", "DEFAULT_COMPILATION_CACHE", "FASTER_CPU_COMPILATION", "compilation_cache_setting",
    "compilation_stats", "count_compilations", "enable_compilation_cache", "faster_cpu_compilation", "metered",
    "one_blas_thread_per_worker",
    # endings
    "CHIP_FAULTED", "CHIP_FAULTED_EXIT_CODE", "HALT_EXIT_CODE", "HALT_MESSAGES", "HANG_EXIT_CODE",
    "SLOW_EXIT_CODE", "call_timeout", "end_on_halt", "on_halt", "on_hang", "set_output_release", "watchdog",
    # interpreter_reports
    "CHECKING_INTERPRET_PARAMS", "WOULD_HALT_A_TPU", "Deadlock", "RaceDetected", "WouldHaltTpu",
]  # fmt: skip
