#!/usr/bin/env bash
# First thing to run on a fresh TPU VM: installs .[tpu] (ci/install_for_tpu.sh: skipped where jax, libtpu and
# the harness import already, or with RPA_SKIP_INSTALL=1), then `rpa-harness chip smoke`: the TPU generation
# and versions, then a few examples of every property compiled for the TPU (--rpa-backend=tpu) against our
# kernel and upstream's, each ending with the summary table, its log and repros under chip-logs/. Meant to
# finish in under 10 minutes; each target is given RPA_SMOKE_SECONDS (default 270 s), a quick one leaving its
# time to the next, and one cut off counts as a failure. Without a visible TPU it exits 4.
# Run on a TPU v5e (docs/measurements.md, "On a TPU v5e"); this repo's CI has no TPU and never runs it.
set -uo pipefail
cd "$(dirname "$0")/.."
bash ci/install_for_tpu.sh || exit 4
exec rpa-harness chip smoke --seconds $((2 * ${RPA_SMOKE_SECONDS:-270})) --logs "${RPA_CHIP_LOGS:-chip-logs}"
