#!/usr/bin/env bash
# On a TPU host, from a checkout with chip-carry/ (ci/chip_carry.sh): the measurements a chip session owes
# docs/measurements.md ("On a TPU v5e"), in steps, each with its own time limit and log, so that a session
# of a few commands of under 10 minutes each can split them. Each step is one `rpa-harness chip STEP` (or
# `rpa-harness run`/`bench`) on this repo's targets: what it does is rpa_harness/chip/, which a user's own
# session runs from the wheel alone (docs/nightly-tpu.md).
#
#   bash ci/chip_session.sh smoke calibrate-1 ...
#
#   smoke        rpa-harness chip smoke: the bundled kernel and upstream's, -n 1, a first check of a fresh host
#   owner        the bundled kernel's dev profile with 12 workers feeding one chip owner (rpa_harness.device.owner)
#   calibrate-N  rpa-harness chip calibrate on one group of shipped targets: each target's dev profile on the
#                chip, the group's targets in one run (one start-up), 12 workers feeding one chip owner
#                (RPA_CALIBRATE_WORKERS; RPA_MAX_EXAMPLES, default 3), ending with its summary and a line per
#                target; a target this jax cannot load (its kernel needs another jax, or is not installed) is
#                named with the reason and skipped
#   calibrate    every group, one after the other (a host without a limit per command)
#   verdicts-N   rpa-harness chip verdicts on group N's targets: each declared finding's verdict on this chip
#                (halting repros replayed in processes of their own), as a table in verdicts-N.md
#   verdicts     every group's verdicts, one after the other
#   agreement-N  rpa-harness chip agreement on chip-carry/agreement, group N's targets (50 configurations each)
#   agreement    every group's, one after the other
#   arithmetic   benchmarks/chip_arithmetic.py
#   throughput-pooled, throughput-any-config
#                rpa-harness chip throughput: that differential property of the bundled kernel and v3, 12
#                workers (RPA_THROUGHPUT_WORKERS) feeding a chip owner, each row 180 s after its first
#                example: the steady rate, the signatures compiled, where a call's and a case's time goes
#   speed        rpa-harness bench: the bundled kernel, upstream's and v3 at the serving batches
#   v3-tuning    rpa-harness bench --sweep-blocks on v3 (mixed, decode): its tuning finding's verdict, a report
#   v3-speed     rpa-harness chip speed: v3's and upstream's time per batch through bench's call and bare,
#                and v3's own choice of block sizes
#   q-len-zero   rpa-harness chip q-len-zero: v3's q-len-zero-before-a-live-sequence-hangs step by step
#
# The calibration groups (CALIBRATE_GROUPS below) hold every shipped target once; on jax 0.10.2 (Python 3.11,
# the chip images') ten run, mla_swa needing jax >= 0.12 and stacked RPA jax < 0.12:
#
#   calibrate-1  the bundled kernel, upstream's, tpu-inference's v2 and v3
#   calibrate-2  tpu-inference's MLA v1, MLA v2 and the head_dim-64 kernel
#   calibrate-3  tpu-inference's batched RPA, the CP fork of v3, stacked RPA and mla_swa
#
# A group is one command of under 10 minutes, one `rpa-harness run` of its targets: they share
# RPA_CALIBRATE_SECONDS (default 510 s), the run giving each what is left of 90% of it divided by the targets
# still to run and skipping the tests of a target past its share (rpa_harness.chip.campaign); a run still
# going at the full budget is cut off without its summary (exit 124 on its line). The three groups, `bash
# ci/chip_session.sh calibrate-1`, then -2, then -3, within 30 minutes of chip time. A dev-profile run of one
# target takes 60-250 s on a v5e.
#
# Each step runs in a session of its own, and whatever it leaves running is ended with it, by that session's
# id: never another process of the host. Logs (a step's STEP.log; the smoke's target's smoke-TARGET.log, a
# calibration group's run's calibrate-TARGETS.log), repro folders and kept failures go to $RPA_CHIP_LOGS
# (default chip-logs/), and all of it into one archive,
# $RPA_CHIP_LOGS.tgz (a machine that returns few files returns that one). Exit: 0 when every step exited 0, 4
# for an unknown step (before anything runs), else 1 (each step's code is in its log and in the step's last
# line).
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
steps="smoke owner calibrate verdicts$groups agreement arithmetic throughput-pooled throughput-any-config speed v3-speed v3-tuning q-len-zero"
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

named() {  # GROUP_NUMBER: --target for each of that group's targets
  local target
  for target in ${CALIBRATE_GROUPS[$1 - 1]}; do printf -- '--target\n%s\n' "$target"; done
}

calibrate() {  # GROUP_NUMBER: that group's targets, sharing RPA_CALIBRATE_SECONDS
  local seconds="${RPA_CALIBRATE_SECONDS:-510}"
  local -a targets
  mapfile -t targets < <(named "$1")
  step "calibrate-$1" $((seconds + 60)) rpa-harness chip calibrate "${targets[@]}" --seconds "$seconds" \
    --workers "${RPA_CALIBRATE_WORKERS:-12}" --logs "$logs"
}

verdicts() {  # GROUP_NUMBER: the verdict of each declared finding of that group's targets on this chip
  local -a targets
  mapfile -t targets < <(named "$1")
  step "verdicts-$1" 560 rpa-harness chip verdicts "${targets[@]}" --markdown "$logs/verdicts-$1.md"
}

agreement() {  # GROUP_NUMBER: the agreement check on that group's predicted configurations
  local -a targets
  mapfile -t targets < <(named "$1")
  step "agreement-$1" 560 rpa-harness chip agreement --folder chip-carry/agreement "${targets[@]}"
}

for name in "$@"; do
  case "$name" in
    smoke) step smoke 450 rpa-harness chip smoke --seconds $((2 * ${RPA_SMOKE_SECONDS:-200})) --logs "$logs" ;;
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
      step "$name" 560 rpa-harness chip throughput --seconds 180 --max-seconds 270 \
        --workers "${RPA_THROUGHPUT_WORKERS:-12}" --properties "${name#throughput-}" --cache cold \
        --cache-dir /tmp/rpa-bench-cache --repro-dir "$logs/repros/$name" ;;
    speed)
      step speed 300 rpa-harness bench --target rpa_harness.kernel --target rpa_harness.targets.tpu_inference_v3 \
        --json "$logs/bench.json" ;;
    v3-speed)
      step v3-speed 200 rpa-harness chip speed --target jax.experimental.pallas.ops.tpu.ragged_paged_attention \
        --target rpa_harness.targets.tpu_inference_v3 ;;
    v3-tuning)  # v3's own block sizes against every pair it accepts on the mixed and decode batches
      step v3-tuning 400 rpa-harness bench --target rpa_harness.targets.tpu_inference_v3 --batch mixed,decode \
        --sweep-blocks --baseline none --report-dir "$logs" ;;
    q-len-zero) step q-len-zero 300 rpa-harness chip q-len-zero --timeout 30 ;;
  esac
done
[ -d rpa-repros ] && cp -r rpa-repros "$logs/"
tar czf "$logs.tgz" "$logs"
echo "chip_session: logs in $logs.tgz"
exit $status
