#!/usr/bin/env bash
# The harness as a kernel developer gets it: build the wheel, install it in a fresh virtual environment, and
# from a folder outside this repo run `rpa-harness run` against a kernel module written there (it must pass)
# and against a broken one (it must fail), then type-check the installed package with mypy (the dev extra's,
# configured in pyproject.toml). A packaging regression (a module left out of the wheel, the plugin not
# registered, a path into the checkout, the py.typed marker missing) fails here.
#   usage: bash ci/wheel_check.sh PYTHON
set -euo pipefail
python=${1:-python3}
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/rpa-wheel-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
started=$SECONDS

"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --upgrade pip
"$work/venv/bin/python" -m pip wheel -q --no-deps -w "$work/dist" "$repo"
wheel=$(ls "$work"/dist/rpa_harness-*.whl)
"$work/venv/bin/python" - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
top = sorted({name.split("/", 1)[0] for name in names})
print(f"wheel {sys.argv[1].rsplit('/', 1)[-1]}: {len(names)} files, top-level names: {', '.join(top)}")
generic = [name for name in top if not name.startswith("rpa_harness")]
if generic:
    sys.exit(f"the wheel installs top-level names other than rpa_harness: {generic}")
for required in ("rpa_harness/plugin.py", "rpa_harness/properties/test_differential.py",
                 "rpa_harness/kernel/pallas_rpa.py", "rpa_harness/findings/upstream-findings/README.md",
                 "rpa_harness/chip/verdicts.py", "rpa_harness/py.typed"):
    if required not in names:
        sys.exit(f"the wheel lacks {required}")
PY
"$work/venv/bin/python" -m pip install -q "$wheel"

mkdir "$work/user"
cd "$work/user"
cat > my_rpa.py <<'PY'
"""A user's kernel module: here the bundled kernel behind the user's own module name."""
from rpa_harness.kernel import dynamic_validate_inputs, ragged_paged_attention  # noqa: F401
PY
cat > my_broken_rpa.py <<'PY'
"""A user's kernel module with a bug: every output is off by one part in a thousand."""
from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401
from rpa_harness.kernel import ragged_paged_attention as _correct


def ragged_paged_attention(*args, **kwargs):
    out = _correct(*args, **kwargs)
    return (out.astype("float32") * 1.001).astype(out.dtype)
PY
if "$work/venv/bin/python" -c "import harness" 2>/dev/null || "$work/venv/bin/python" -c "import kernel" 2>/dev/null; then
  echo "wheel check: a generic top-level name (harness or kernel) is importable from the installed wheel" >&2
  exit 1
fi
echo "=== wheel check: rpa-harness run against my_rpa (must pass)"
# A few examples per property: the subject here is the package (every property module collected and run),
# not the kernel, which the suite tests.
RPA_MAX_EXAMPLES=3 "$work/venv/bin/rpa-harness" run --profile dev --backend fast-interpret --target my_rpa -n 2 \
  --repro-dir repros-ok
echo "=== wheel check: rpa-harness run against my_broken_rpa (must fail)"
set +e
"$work/venv/bin/rpa-harness" run --profile dev --backend fast-interpret --target my_broken_rpa -n 0 \
  --repro-dir repros-broken -- -x > broken.log 2>&1  # one process: under xdist, -x exits 2 (interrupted)
code=$?
set -e
tail -n 25 broken.log
if [ "$code" -ne 1 ] || ! ls repros-broken/*.json >/dev/null 2>&1; then
  echo "wheel check: the broken kernel gave exit $code (expected 1, with a repro in repros-broken/)" >&2
  exit 1
fi
echo "=== wheel check: mypy -p rpa_harness on the installed package"
# After the runs, so that they see the wheel as a user installs it. mypy reads the package from the venv's
# site-packages (a typed package: its py.typed), not from this checkout, whose folders it cannot map.
"$work/venv/bin/python" -m pip install -q "$wheel[dev]"
"$work/venv/bin/mypy" --config-file "$repo/pyproject.toml" -p rpa_harness
echo "=== wheel check passed in $((SECONDS - started)) s (the broken kernel failed with exit 1 and left $(ls repros-broken/*.json | wc -l) repro(s))"
