"""The target's kernel compiles for each chosen TPU generation, on every configuration it accepts.

The interpreters run configurations a chip refuses (Mosaic's tiling rules, the chip's scoped VMEM). With
libtpu installed (``pip install "rpa-harness[compile]"``), each drawn valid configuration, from every bucket
the target declares (production and long included, block sizes given, tuned or the kernel's own; the VMEM
limit the kernel's own), is compiled
ahead of time for a slice of each generation that the run emulates (``--rpa-tpu-generation``; where it
emulates none, v5e and v6e, and under the nightly profile every generation the compiler knows): no chip, no
call, 3-4 s of the compiler an example on a 2-core host whatever its shapes (``rpa_harness.ahead_of_time``). A refusal is a failure
of its own kind, shrunk, with a repro that stores the shapes alone and replays with ``rpa-harness replay``.
Without libtpu the property is skipped, with the install command as its reason.
"""

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from rpa_harness.checks import check_compiles
from rpa_harness.properties.budget import COMPILE_EXAMPLES
from rpa_harness.property_names import COMPILATION, PropertyName
from rpa_harness.recording import recorded
from rpa_harness.repro import stand_ins
from rpa_harness.strategies.buckets import LARGE_BUCKETS
from rpa_harness.strategies.shapes import select_buckets
from rpa_harness.strategies.valid import outside_known_issues, valid_cases


def every_declared_bucket(capabilities):
    """The selection of every bucket the target declares: compiling costs the same at any size."""
    return select_buckets(capabilities, ",".join(capabilities.buckets))


@settings(max_examples=COMPILE_EXAMPLES)
@given(data=st.data())
def test_kernel_compiles_for_the_chip(target, compile_backend, repro_dir, data):
    capabilities = target.capabilities_on(compile_backend)
    selection = every_declared_bucket(capabilities)
    excluding = target.known_issues_on(compile_backend)
    small = valid_cases(capabilities, excluding=excluding, selection=selection)
    large = (
        [valid_cases(capabilities, large=True, excluding=excluding, selection=selection)]
        if any(name in LARGE_BUCKETS for name in selection or ())
        else []
    )
    case = data.draw(st.one_of(small, *large), label="case")
    # The kernel's own VMEM limit: one a caller passes is its budget for the block sizes it passes, and
    # blocks over it are refused on any chip, whatever the kernel.
    case = outside_known_issues(dataclasses.replace(case, vmem_limit_bytes=None), excluding)
    arrays, options = stand_ins(case.array_shapes()), case.options()
    name = PropertyName(COMPILATION, "", compile_backend.label)
    with recorded(repro_dir, name, target, compile_backend, arrays, options, case=case, shapes_only=True):
        check_compiles(target, compile_backend, arrays, options)
