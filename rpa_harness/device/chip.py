"""The chip: whether this process may use a TPU and which (the probe), and the known-good call that shows a
chip computes before a process's first kernel call on it.

Whether a TPU is present is asked in one of two ways. A process that runs kernels (an xdist worker, or a run
without workers) asks jax directly, which opens the chips: it is the process that will use them. The xdist
controller runs no kernel and must leave the chips closed, since libtpu lets one process open a chip and
the workers it starts need it: it asks a short-lived child process, which opens the chips, prints what it
saw and exits (releasing them) before any worker starts. A child rather than a guess from the environment
(PCI ids, /dev/accel*): it answers with jax's own verdict, so a chip jax cannot open is no chip.
Without libtpu, jax can see no TPU, and no child is started (a CPU machine pays nothing).
"""

import dataclasses
import functools
import importlib.util
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from rpa_harness import generations, lowering
from rpa_harness.device import endings, processes

_chip_checked = False


def _copy_and_add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0


def known_good_call() -> None:
    """A small Pallas kernel whose inputs and output are copied by DMA (the engine a faulted chip fails in),
    checked for its value: it runs right on every TPU."""
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    out = pl.pallas_call(_copy_and_add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    if not np.array_equal(np.asarray(out), np.asarray(x) + 1.0):
        raise RuntimeError("the known-good call returned a wrong value: the chip computes wrongly")


def on_a_real_chip() -> bool:
    """Whether the default device is a TPU: its platform, which neither an emulated generation nor a test's
    simulated device kind changes."""
    return jax.devices()[0].platform == "tpu"


def check_the_chip_once() -> None:
    """The known-good call, once a process, before its first kernel call on a chip; a chip that fails it
    ends the process (``endings.CHIP_FAULTED_EXIT_CODE``) before an example is blamed."""
    global _chip_checked
    if _chip_checked or not on_a_real_chip():
        return
    try:
        known_good_call()
    except Exception as error:
        endings.end_chip_faulted(
            endings.halt_report(error) or f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
        )
    _chip_checked = True


TPU_PROBE_ENV = "RPA_TPU_PROBE"  # "none" or "KIND:COUNT" (e.g. "TPU v5 lite:1"): the answer, without asking
PROBE_SECONDS = 300.0
_PROBE_PROGRAM = """
import json, jax
try:
    devices = jax.devices("tpu")
except RuntimeError:
    devices = []
print(json.dumps({"count": len(devices), "kinds": sorted({d.device_kind for d in devices})}))
"""


@dataclasses.dataclass(frozen=True)
class Tpus:
    """The TPU devices a process sees: how many, and their kind as jax names it (e.g. "TPU v5 lite")."""

    count: int = 0
    kind: str = ""

    def __bool__(self) -> bool:
        return self.count > 0


class TpuProbeError(RuntimeError):
    """The child process that looks for TPUs did not answer; the message says why and what to do."""


_keep_off_the_chips = False


def keep_off_the_chips() -> None:
    """Marks this process as one that runs no kernel (the xdist controller): it asks a child process whether
    a TPU is present, and computes on the CPU if anything (a target computing at import) initialises jax,
    so that it never holds a chip its workers need."""
    global _keep_off_the_chips
    _keep_off_the_chips = True
    jax.config.update("jax_platforms", "cpu")
    tpus.cache_clear()


def _stated_tpus(answer: str) -> Tpus:
    if answer.strip().lower() in ("", "none", "0"):
        return Tpus()
    kind, _, count = answer.rpartition(":")
    if not kind or not count.strip().isdigit():
        raise TpuProbeError(
            f"{TPU_PROBE_ENV}={answer!r} is not 'none' or KIND:COUNT (e.g. 'TPU v5 lite:1'); "
            "unset it to ask jax"
        )
    return Tpus(int(count), kind.strip())


def _libtpu_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None or bool(os.environ.get("TPU_LIBRARY_PATH"))


def _probe_in_a_child() -> Tpus:
    done = processes.run(processes.python("-c", _PROBE_PROGRAM), timeout=PROBE_SECONDS)
    if done.timed_out:
        raise TpuProbeError(
            f"the child process asking jax for TPUs did not answer within {PROBE_SECONDS:g} s; check that no "
            f"other process holds the chips, or set {TPU_PROBE_ENV}=KIND:COUNT"
        )
    try:
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        return Tpus(seen["count"], ", ".join(seen["kinds"]))
    except (IndexError, ValueError, KeyError):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise TpuProbeError(
            f"the child process asking jax for TPUs exited {done.returncode} without an answer ({last}); "
            f"run {sys.executable} -c 'import jax; print(jax.devices())' to see why"
        ) from None


@functools.cache
def tpus() -> Tpus:
    """The TPUs this process may use: from TPU_PROBE_ENV when set, else asked of jax (here, or in a child
    process where this process keeps off the chips)."""
    if TPU_PROBE_ENV in os.environ:
        return _stated_tpus(os.environ[TPU_PROBE_ENV])
    if not _libtpu_installed():
        return Tpus()
    if _keep_off_the_chips:
        return _probe_in_a_child()
    try:
        devices = jax.devices("tpu")
    except RuntimeError:
        return Tpus()
    return Tpus(len(devices), ", ".join(sorted({device.device_kind for device in devices})))


GOOGLE_PCI_VENDOR = "0x1ae0"  # a TPU chip's PCI vendor id, in sysfs


def chips_on_this_host(
    dev: Path = Path("/dev"), iommu_groups: Path = Path("/sys/kernel/iommu_groups")
) -> int:
    """How many TPU chips this host has, counted from their device files without opening libtpu (which would
    take them all): /dev/accel0, /dev/accel1, ... where the chips have the accel driver (v4), else the
    numbered VFIO groups under /dev/vfio (v5e, v5p, v6e) whose device is Google's, so that another device
    bound to vfio-pci is not counted (as tpu-inference's ``tpu_info.get_num_chips`` counts them, with ray's
    vendor check, ray-project/ray#65034). Not whether jax can open them (``tpus``), only how many a run may
    pin an owner each to; 0 on a host with neither."""
    accelerators = sorted(dev.glob("accel[0-9]*"))
    if accelerators:
        return len(accelerators)
    try:
        groups = [entry.name for entry in (dev / "vfio").iterdir() if entry.name.isdigit()]
    except OSError:
        return 0
    return sum(1 for group in groups if _google_device_in(iommu_groups / group / "devices"))


def _google_device_in(devices: Path) -> bool:
    try:
        return any(
            (device / "vendor").read_text().strip() == GOOGLE_PCI_VENDOR for device in devices.iterdir()
        )
    except OSError:
        return False


def tpu_available() -> bool:
    return bool(tpus())


def chip_generation() -> str:
    """The generation of the chip this process's kernel calls run on (``tpus``: as the process that holds it
    names it, its own or a chip owner's), or ``none``."""
    return lowering.generation_of_device_kind(tpus().kind) or generations.NONE


def chip_in_words() -> str:
    """That chip as the compile property names a generation: "v5e (TPU v5 lite)"."""
    return f"{chip_generation()} ({tpus().kind})"
