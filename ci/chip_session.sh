#!/usr/bin/env bash
# On a TPU host, from a checkout with chip-carry/ (ci/chip_carry.sh): the measurements a chip session owes
# docs/measurements.md ("On a TPU v5e"), in steps, each with its own time limit and log, so that a session
# of a few commands of under 10 minutes each can split them:
#
#   bash ci/chip_session.sh smoke calibrate agreement arithmetic throughput speed
#
#   smoke        ci/tpu_smoke.sh: the bundled kernel and upstream's, -n 1
#   calibrate    every other shipped target that runs on this jax, its dev profile on the chip, -n 1
#                (RPA_MAX_EXAMPLES, default 4), one summary each
#   agreement    ci/chip_agreement.py check on chip-carry/agreement
#   arithmetic   benchmarks/chip_arithmetic.py
#   throughput   benchmarks/bench_throughput.py --backend tpu, bundled and v3, failing cases kept
#   speed        rpa-harness bench: the bundled kernel, upstream's and v3 at the serving batches
#
# Logs, repro folders and kept failures go to $RPA_CHIP_LOGS (default chip-logs/), and all of it into one
# archive, $RPA_CHIP_LOGS.tgz (a machine that returns few files returns that one). Exit: 0 when every step
# exited 0, else 1 (each step's code is in its log and in the step's last line).
set -uo pipefail
cd "$(dirname "$0")/.."
logs="${RPA_CHIP_LOGS:-chip-logs}"
mkdir -p "$logs"
if ! python3 -c "import rpa_harness, xdist" 2>/dev/null; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/rpa-site chip-carry/wheels/*.whl || exit 4
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/rpa-site" PATH="/tmp/rpa-site/bin:$PATH"
fi
# Scripts that start `python` find the interpreter that has the harness.
mkdir -p /tmp/rpa-bin && ln -sf "$(command -v python3)" /tmp/rpa-bin/python && export PATH="/tmp/rpa-bin:$PATH"
export PYTHONUNBUFFERED=1 RPA_SKIP_INSTALL=1
status=0

step() {  # NAME SECONDS COMMAND...: one step, its log, its exit code; no process of it outlives it
  local name=$1 seconds=$2 started=$SECONDS code
  shift 2
  timeout -k 10 "$seconds" "$@" >"$logs/$name.log" 2>&1
  code=$?
  pkill -9 -f "pytest|chip_agreement|bench_throughput|chip_arithmetic|rpa-harness bench" 2>/dev/null
  sleep 2  # the chip is released with its process
  echo "=== $name: exit $code in $((SECONDS - started)) s" | tee -a "$logs/$name.log"
  [ "$code" -ne 0 ] && status=1
  return 0
}

calibrate() {
  local target
  for target in rpa_harness.targets.tpu_inference_v3 rpa_harness.targets.tpu_inference_v3_hd64 \
    rpa_harness.targets.tpu_inference_v2 rpa_harness.targets.tpu_inference_mla_v1 rpa_harness.targets.tpu_inference_mla_v2 \
    rpa_harness.targets.tpu_inference_rpa_v3_cp rpa_harness.targets.tpu_inference_batched_rpa \
    rpa_harness.targets.tpu_inference_stacked_rpa; do
    step "calibrate-$target" "${RPA_CALIBRATE_SECONDS:-240}" rpa-harness run --profile dev --backend tpu \
      --target "$target" -n 1 --repro-dir "$logs/repros/$target"
  done
}

for name in "$@"; do
  case "$name" in
    smoke) RPA_SMOKE_SECONDS="${RPA_SMOKE_SECONDS:-200}" step smoke 450 bash ci/tpu_smoke.sh ;;
    calibrate) RPA_MAX_EXAMPLES="${RPA_MAX_EXAMPLES:-4}" calibrate ;;
    agreement) step agreement 540 python3 ci/chip_agreement.py check --folder chip-carry/agreement ;;
    arithmetic) step arithmetic 120 python3 benchmarks/chip_arithmetic.py ;;
    throughput)
      step throughput 540 python3 benchmarks/bench_throughput.py --backend tpu --examples 600 --seconds 60 \
        --properties pooled,pooled-groups,any-config \
        --cache cold,warm --cache-dir /tmp/rpa-bench-cache --failures-dir "$logs/failures" ;;
    speed)
      step speed 300 rpa-harness bench --target rpa_harness.kernel --target rpa_harness.targets.tpu_inference_v3 \
        --json "$logs/bench.json" ;;
    *) echo "chip_session: unknown step '$name'; steps: smoke calibrate agreement arithmetic throughput speed" >&2
      exit 4 ;;
  esac
done
[ -d rpa-repros ] && cp -r rpa-repros "$logs/"
tar czf "$logs.tgz" "$logs"
echo "chip_session: logs in $logs.tgz"
exit $status
