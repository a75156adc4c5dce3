#!/usr/bin/env bash
# The install step of the TPU scripts (ci/tpu_smoke.sh, ci/nightly_tpu.sh): `pip install -e ".[tpu]"`, unless
# what it would install is importable already (jax, libtpu and the harness) or RPA_SKIP_INSTALL=1. A chip host
# is often set up with jax[tpu] and no network, where pip would fail for nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${RPA_SKIP_INSTALL:-0}" = 1 ]; then
  echo "install: skipped (RPA_SKIP_INSTALL=1)"
elif python -c "import jax, libtpu, rpa_harness" 2>/dev/null && command -v rpa-harness >/dev/null; then
  echo "install: skipped (jax, libtpu and rpa_harness import, rpa-harness is on PATH)"
else
  python -m pip install -q -e ".[tpu]" || {
    echo "install: pip install -e '.[tpu]' failed; install jax[tpu] and the harness," \
      "or set RPA_SKIP_INSTALL=1" >&2
    exit 4
  }
fi
