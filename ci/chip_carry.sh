#!/usr/bin/env bash
# On a machine with a network, for a TPU host without one: puts into chip-carry/ what ci/chip_session.sh
# installs there (the harness's wheel; pytest-xdist, execnet and pytest-timeout, which a chip image with
# jax[tpu], pytest and hypothesis may lack; tpu-inference without its dependencies, for its targets) and the
# CPU host's predictions for `rpa-harness chip agreement` (libtpu needed here: pip install "rpa-harness[compile]").
#
#   bash ci/chip_carry.sh [PYTHON_VERSION (default 3.11)] [GENERATION (default v5e)]
#
# Carry the folder with the checkout (it is ignored by git), then run ci/chip_session.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
python_version="${1:-3.11}"
generation="${2:-v5e}"
carry=chip-carry
rm -rf "$carry" && mkdir -p "$carry/wheels"
python -m pip wheel --no-deps -q -w "$carry/wheels" .
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# The harness's own dependencies a chip image may not have, at the versions installed here.
wanted=()
for name in pytest-xdist execnet pytest-timeout tpu-inference; do
  version=$(python -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$version" ] && wanted+=("$name==$version")
done
python -m pip download --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
  "${platforms[@]}" -q -d "$carry/wheels" "${wanted[@]}"
python -m rpa_harness.cli chip agreement --predict --folder "$carry/agreement" --count 50 --tpu-generation "$generation"
du -sh "$carry"
ls "$carry/wheels"
