#!/usr/bin/env bash
# CI entry point: the whole test suite in interpret mode (both interpreters), ci profile, 2 workers.
# Writes JUnit XML to ${RPA_JUNIT:-reports/junit.xml}; per-test timeouts come from pyproject (thread method).
set -euo pipefail
cd "$(dirname "$0")/.."
export HYPOTHESIS_PROFILE=ci
mkdir -p reports
exec python -m pytest -n 2 --hypothesis-profile=ci --rpa-backend=auto \
  --rpa-repro-dir="${RPA_REPRO_DIR:-rpa-repros}" --junitxml="${RPA_JUNIT:-reports/junit.xml}" "$@"
