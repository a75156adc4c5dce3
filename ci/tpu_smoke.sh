#!/usr/bin/env bash
# First thing to run on a fresh TPU VM: installs .[tpu] (ci/install_for_tpu.sh: skipped where jax, libtpu and
# the harness import already, or with RPA_SKIP_INSTALL=1), prints the TPU generation and versions, then runs a
# few examples of every property compiled for the TPU (--rpa-backend=tpu) against our kernel and upstream's,
# each ending with the summary table. Meant to finish in under 10 minutes; each target is cut off after
# RPA_SMOKE_SECONDS (default 270 s) and that counts as a failure.
# Run on a TPU v5e (docs/measurements.md, "On a TPU v5e"); this repo's CI has no TPU and never runs it.
set -uo pipefail
cd "$(dirname "$0")/.."
bash ci/install_for_tpu.sh || exit 4
python - <<'PY' || { echo "tpu smoke: no TPU visible to jax; this script is for a TPU VM" >&2; exit 4; }
import platform, sys
import hypothesis, jax, jaxlib, numpy
tpus = jax.devices("tpu")  # raises RuntimeError when there is none
kinds = sorted({d.device_kind for d in tpus})
print(f"TPU: {len(tpus)} device(s), {', '.join(kinds)}")
print(f"python {platform.python_version()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
      f"numpy {numpy.__version__}, hypothesis {hypothesis.__version__}")
PY
seconds="${RPA_SMOKE_SECONDS:-270}"
status=0
for target in rpa_harness.kernel jax.experimental.pallas.ops.tpu.ragged_paged_attention; do
  echo "=== tpu smoke: $target"
  started=$SECONDS
  # One worker, which opens the chip (the controller never does): a halt or a libtpu abort ends the worker,
  # not the run, and the summary names the suspect. A few examples per property.
  RPA_MAX_EXAMPLES="${RPA_MAX_EXAMPLES:-4}" timeout "$seconds" \
    rpa-harness run --profile dev --backend tpu --target "$target" -n 1 --repro-dir "rpa-repros/smoke/$target"
  code=$?
  [ "$code" -eq 124 ] && echo "tpu smoke: $target did not finish within $seconds s" >&2
  [ "$code" -ne 0 ] && status=1
  echo "=== tpu smoke: $target exit $code in $((SECONDS - started)) s"
done
exit $status
