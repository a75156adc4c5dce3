#!/usr/bin/env bash
# Nightly entry point on a TPU host: installs .[tpu] (ci/install_for_tpu.sh: skipped where jax, libtpu and the
# harness import already, or with RPA_SKIP_INSTALL=1), times the kernels at serving batches (`rpa-harness
# bench`, targets RPA_BENCH_TARGETS, default the bundled kernel, each with its baseline), then runs the
# properties compiled for TPU with the nightly profile over the production mix of buckets (RPA_BUCKETS,
# default small,medium,production), in rounds until RPA_TIME_BUDGET seconds are spent, against each target:
#
#   bash ci/nightly_tpu.sh [--targets MODULE[,MODULE...]]
#
# The targets: those --targets names, else RPA_NIGHTLY_TARGETS (the same list), else every shipped target this
# jax loads (on jax 0.10.2 all but mla_swa; one whose kernel is not installed is named with the reason and
# left out). A named target that does not load, or an unknown argument, is a one-line usage error (exit 4).
# Each round prints one line; `rpa-harness run` prints progress while it runs and its summary table after.
# Kept between nightly runs (restore them before, save them after, even on failure): the Hypothesis example
# database in $RPA_HYPOTHESIS_DB, jax's compilation cache in $RPA_COMPILATION_CACHE (default
# .jax-compilation-cache), and the last bench without a regression in $RPA_BENCH_DIR/previous.json (default
# .rpa-bench): a target more than RPA_BENCH_MAX_SLOWDOWN (default 1.2) times slower than there fails the
# night, and stays failed until it is fast again. Repro files go to $RPA_REPRO_DIR/<target>/. This repo's CI
# has no TPU and never runs it.
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash ci/nightly_tpu.sh [--targets MODULE[,MODULE...]]"
named="${RPA_NIGHTLY_TARGETS:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --targets=?*) named="${1#--targets=}" ;;
    --targets)
      [ -n "${2:-}" ] || { echo "nightly: --targets needs a list of target modules; $usage" >&2; exit 4; }
      named="$2"
      shift ;;
    *) echo "nightly: unknown argument '$1'; $usage" >&2
      exit 4 ;;
  esac
  shift
done
bash ci/install_for_tpu.sh || exit 4
# The targets to run, a line each: the named ones (one that does not load is a usage error, its reason the
# line), else every shipped one this jax loads (the others named, with why, on stderr).
listed=$(JAX_PLATFORMS=cpu python - ${named//,/ } <<'PY'
import sys
from rpa_harness import targets
named = sys.argv[1:]
for name in named or [shipped.name for shipped in targets.SHIPPED]:
    try:
        targets.load(name)
    except targets.TargetError as error:
        print(f"nightly: {error}", file=sys.stderr)
        if named:
            sys.exit(4)
    else:
        print(name)
PY
) || exit 4
mapfile -t run_targets <<<"$listed"
echo "nightly targets: ${run_targets[*]}"
export RPA_HYPOTHESIS_DB="${RPA_HYPOTHESIS_DB:-.hypothesis/examples}"
export RPA_BUCKETS="${RPA_BUCKETS:-small,medium,production}"
export RPA_PROGRESS_SECONDS="${RPA_PROGRESS_SECONDS:-120}"
budget="${RPA_TIME_BUDGET:-3600}"
repro_root="${RPA_REPRO_DIR:-rpa-repros}"
mkdir -p reports "$repro_root"
status=0
bench_dir="${RPA_BENCH_DIR:-.rpa-bench}"
mkdir -p "$bench_dir"
bench_targets=()
for target in ${RPA_BENCH_TARGETS:-rpa_harness.kernel}; do bench_targets+=(--target "$target"); done
rpa-harness bench "${bench_targets[@]}" --json reports/bench.json --previous "$bench_dir/previous.json" \
  --max-slowdown "${RPA_BENCH_MAX_SLOWDOWN:-1.2}"
code=$?
if [ "$code" -eq 0 ]; then
  cp reports/bench.json "$bench_dir/previous.json"
else
  status=1
fi
echo "nightly bench: exit $code (reports/bench.json)"
start=$SECONDS
round=0
while [ $((SECONDS - start)) -lt "$budget" ]; do
  round=$((round + 1))
  verdicts=""
  for target in "${run_targets[@]}"; do
    rpa-harness run --profile nightly --backend tpu --target "$target" -n 1 \
      --repro-dir "$repro_root/$target" --junit "reports/nightly-$target-round$round.xml"
    code=$?
    [ "$code" -ne 0 ] && status=1
    verdicts="$verdicts $target=exit$code"
  done
  echo "nightly round $round done at $((SECONDS - start)) s of $budget s:$verdicts"
done
echo "nightly: $round round(s) in $((SECONDS - start)) s; repro files under $repro_root"
exit $status
