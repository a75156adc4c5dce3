#!/usr/bin/env bash
# Nightly entry point on a TPU host: installs .[tpu], then runs the properties compiled for TPU with the
# nightly profile, in rounds until RPA_TIME_BUDGET seconds are spent, against our kernel and upstream's.
# The Hypothesis example database lives in $RPA_HYPOTHESIS_DB (restore it before, save it after, even on
# failure); repro files go to $RPA_REPRO_DIR/<target>/.
set -uo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[tpu]"
export HYPOTHESIS_PROFILE=nightly
export RPA_HYPOTHESIS_DB="${RPA_HYPOTHESIS_DB:-.hypothesis/examples}"
budget="${RPA_TIME_BUDGET:-3600}"
repro_root="${RPA_REPRO_DIR:-rpa-repros}"
mkdir -p reports "$repro_root"
status=0
start=$(date +%s)
round=0
while [ $(( $(date +%s) - start )) -lt "$budget" ]; do
  round=$((round + 1))
  for target in kernel jax.experimental.pallas.ops.tpu.ragged_paged_attention; do
    python -m pytest tests/properties/test_differential.py tests/properties/test_validation.py tests/properties/test_padding.py \
      --hypothesis-profile=nightly --rpa-backend=tpu --rpa-target="$target" \
      --rpa-repro-dir="$repro_root/$target" --junitxml="reports/nightly-$target-round$round.xml" -q || status=1
  done
done
echo "nightly: $round round(s) in $(( $(date +%s) - start )) s; repro files under $repro_root"
exit $status
