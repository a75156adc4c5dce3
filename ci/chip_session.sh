#!/usr/bin/env bash
# On a TPU host, from a checkout with chip-carry/ (ci/chip_carry.sh): the measurements a chip session owes
# docs/measurements.md ("On a TPU v5e"), in steps, each with its own time limit and log, so that a session
# of a few commands of under 10 minutes each can split them:
#
#   bash ci/chip_session.sh smoke calibrate-1 ...
#
#   smoke        ci/tpu_smoke.sh: the bundled kernel and upstream's, -n 1, a first check of a fresh host
#   owner        the bundled kernel's dev profile with 12 workers feeding one chip owner (rpa_harness.device.owner)
#   calibrate-N  one group of shipped targets, each target's dev profile on the chip, 12 workers feeding one
#                chip owner (RPA_CALIBRATE_WORKERS; RPA_MAX_EXAMPLES, default 3), ending with its summary; a target this jax cannot load (its kernel needs another
#                jax, or is not installed) is named with the reason and skipped
#   calibrate    every group, one after the other (a host without a limit per command)
#   verdicts-N   ci/chip_verdicts.py on group N's targets: each declared finding's verdict on this chip
#                (halting repros replayed in processes of their own), as a table in verdicts-N.md
#   verdicts     every group's verdicts, one after the other
#   agreement-N  ci/chip_agreement.py check on chip-carry/agreement, group N's targets (50 configurations each)
#   agreement    every group's, one after the other
#   arithmetic   benchmarks/chip_arithmetic.py
#   throughput-pooled, throughput-any-config
#                benchmarks/bench_throughput.py --backend tpu: that differential property of the bundled kernel
#                and v3, 12 workers (RPA_THROUGHPUT_WORKERS) feeding a chip owner, each row 180 s after its
#                first example: the steady rate, the signatures compiled, where a call's and a case's time goes
#   speed        rpa-harness bench: the bundled kernel, upstream's and v3 at the serving batches
#   v3-speed     ci/chip_probe_v3_speed.py: v3's time per batch through bench's call and bare, and per block size
#
# The calibration groups (CALIBRATE_GROUPS below) hold every shipped target once; on jax 0.10.2 (Python 3.11,
# the chip images') ten run, mla_swa needing jax >= 0.12 and stacked RPA jax < 0.12:
#
#   calibrate-1  the bundled kernel, upstream's, tpu-inference's v2 and v3
#   calibrate-2  tpu-inference's MLA v1, MLA v2 and the head_dim-64 kernel
#   calibrate-3  tpu-inference's batched RPA, the CP fork of v3, stacked RPA and mla_swa
#
# A group is one command of under 10 minutes: its targets share RPA_CALIBRATE_SECONDS (default 510 s), each
# given what is left divided by the targets still to run, so that a quick one leaves its time to those after
# it; a target cut off at its share ends without its summary (exit 124 in its log). A group's command ends
# within that budget, 12 s a target (the kill's grace, the chip's release) and the setup; the three groups,
# `bash ci/chip_session.sh calibrate-1`, then -2, then -3, within 30 minutes of chip time. A dev-profile run
# takes 60-250 s on a v5e.
#
# Each step runs in a session of its own, and whatever it leaves running is ended with it, by that session's
# id: never another process of the host. Logs, repro folders and kept failures go to $RPA_CHIP_LOGS (default
# chip-logs/), and all of it into one archive, $RPA_CHIP_LOGS.tgz (a machine that returns few files returns
# that one). Exit: 0 when every step exited 0, 4 for an unknown step (before anything runs), else 1 (each
# step's code is in its log and in the step's last line).
set -uo pipefail
# No job control: a step started with `&` then leads no process group, and setsid makes it a session of its
# own without forking, so that its pid is the session's id.
set +m
cd "$(dirname "$0")/.."

CALIBRATE_GROUPS=(
  "rpa_harness.kernel jax.experimental.pallas.ops.tpu.ragged_paged_attention rpa_harness.targets.tpu_inference_v2 rpa_harness.targets.tpu_inference_v3"
  "rpa_harness.targets.tpu_inference_mla_v1 rpa_harness.targets.tpu_inference_mla_v2 rpa_harness.targets.tpu_inference_v3_hd64"
  "rpa_harness.targets.tpu_inference_batched_rpa rpa_harness.targets.tpu_inference_rpa_v3_cp rpa_harness.targets.tpu_inference_stacked_rpa rpa_harness.targets.tpu_inference_mla_swa"
)
groups=$(for i in "${!CALIBRATE_GROUPS[@]}"; do printf ' calibrate-%d verdicts-%d agreement-%d' $((i + 1)) $((i + 1)) $((i + 1)); done)
steps="smoke owner calibrate verdicts$groups agreement arithmetic throughput-pooled throughput-any-config speed v3-speed"
for name in "$@"; do
  case " $steps " in
    *" $name "*) ;;
    *) echo "chip_session: unknown step '$name'; steps: $steps" >&2
      exit 4 ;;
  esac
done

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
step_session=""

end_step() {  # every process the running step started (its session), and no other
  [ -n "$step_session" ] && pkill -KILL -s "$step_session" 2>/dev/null
  step_session=""
}
trap 'end_step; exit 130' INT
trap 'end_step; exit 143' TERM

step() {  # NAME SECONDS COMMAND...: one step in a session of its own, its log, its exit code
  local name=$1 seconds=$2 started=$SECONDS code
  shift 2
  setsid timeout -k 10 "$seconds" "$@" >"$logs/$name.log" 2>&1 &
  step_session=$!
  wait "$step_session"
  code=$?
  end_step
  sleep 2  # the chip is released with its process
  echo "=== $name: exit $code in $((SECONDS - started)) s" | tee -a "$logs/$name.log"
  [ "$code" -ne 0 ] && status=1
  return 0
}

loadable_targets() {  # MODULE...: each that this jax loads (rpa_harness.targets.load), else why not, a line each
  JAX_PLATFORMS=cpu python3 - "$@" <<'PY'
import sys
from rpa_harness import targets
for name in sys.argv[1:]:
    try:
        targets.load(name)
    except targets.TargetError as error:
        print(f"not run here: {error}")
    else:
        print(name)
PY
}

calibrate() {  # GROUP_NUMBER: that group's targets, one step each, sharing RPA_CALIBRATE_SECONDS
  local group="calibrate-$1" deadline=$((SECONDS + ${RPA_CALIBRATE_SECONDS:-510})) line target left share
  local -a runnable=()
  while IFS= read -r line; do
    case "$line" in
      "not run here: "*) echo "$group: $line" | tee -a "$logs/$group.log" ;;
      *) runnable+=("$line") ;;
    esac
  done < <(loadable_targets ${CALIBRATE_GROUPS[$1 - 1]})
  left=${#runnable[@]}
  for target in "${runnable[@]}"; do
    share=$(((deadline - SECONDS) / left))
    left=$((left - 1))
    RPA_MAX_EXAMPLES="${RPA_MAX_EXAMPLES:-3}" step "calibrate-$target" "$((share > 1 ? share : 1))" \
      rpa-harness run --profile dev --backend tpu --target "$target" -n "${RPA_CALIBRATE_WORKERS:-12}" \
      --repro-dir "$logs/repros/$target"
  done
}

verdicts() {  # GROUP_NUMBER: the verdict of each declared finding of that group's targets on this chip
  local -a named=()
  local target
  for target in ${CALIBRATE_GROUPS[$1 - 1]}; do named+=(--target "$target"); done
  step "verdicts-$1" 560 python3 ci/chip_verdicts.py "${named[@]}" --markdown "$logs/verdicts-$1.md"
}

agreement() {  # GROUP_NUMBER: chip_agreement check on that group's predicted configurations
  step "agreement-$1" 560 python3 ci/chip_agreement.py check --folder chip-carry/agreement \
    --targets ${CALIBRATE_GROUPS[$1 - 1]}
}

for name in "$@"; do
  case "$name" in
    smoke) RPA_SMOKE_SECONDS="${RPA_SMOKE_SECONDS:-200}" step smoke 450 bash ci/tpu_smoke.sh ;;
    owner)
      RPA_MAX_EXAMPLES="${RPA_MAX_EXAMPLES:-20}" step owner 400 rpa-harness run --profile dev --backend tpu \
        --target rpa_harness.kernel -n 12 --repro-dir "$logs/repros/owner" ;;
    calibrate) for i in "${!CALIBRATE_GROUPS[@]}"; do calibrate $((i + 1)); done ;;
    calibrate-*) calibrate "${name#calibrate-}" ;;
    verdicts) for i in "${!CALIBRATE_GROUPS[@]}"; do verdicts $((i + 1)); done ;;
    verdicts-*) verdicts "${name#verdicts-}" ;;
    agreement) for i in "${!CALIBRATE_GROUPS[@]}"; do agreement $((i + 1)); done ;;
    agreement-*) agreement "${name#agreement-}" ;;
    arithmetic) step arithmetic 120 python3 benchmarks/chip_arithmetic.py ;;
    throughput-*)  # the property per target, 12 workers feeding an owner, 180 s after the first example
      step "$name" 560 python3 benchmarks/bench_throughput.py --backend tpu --seconds 180 --max-seconds 270 \
        --workers "${RPA_THROUGHPUT_WORKERS:-12}" --properties "${name#throughput-}" --cache cold \
        --cache-dir /tmp/rpa-bench-cache --repro-dir "$logs/repros/$name" ;;
    speed)
      step speed 300 rpa-harness bench --target rpa_harness.kernel --target rpa_harness.targets.tpu_inference_v3 \
        --json "$logs/bench.json" ;;
    v3-speed) step v3-speed 400 python3 ci/chip_probe_v3_speed.py ;;
  esac
done
[ -d rpa-repros ] && cp -r rpa-repros "$logs/"
tar czf "$logs.tgz" "$logs"
echo "chip_session: logs in $logs.tgz"
exit $status
