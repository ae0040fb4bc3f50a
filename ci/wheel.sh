#!/usr/bin/env bash
# The release artefacts, tested as a user gets them: `python -m build` makes the sdist and the wheel, then the wheel
# (with its hf extra) goes into a fresh virtual environment, and from a folder with no checkout in sight it imports
# dropbp and dropbp.backends and runs `dropbp check` on the CPU. ci/test.sh runs it after the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv/bin/python -m pip install --quiet -c ci/constraints.txt build
.venv/bin/python -m build --no-isolation --outdir "$work/dist" . >"$work/build.log" 2>&1 \
  || { cat "$work/build.log"; echo "ci/wheel.sh: python -m build failed" >&2; exit 1; }
wheel=$(ls "$work"/dist/dropbp-*.whl)
ls "$work"/dist/dropbp-*.tar.gz >/dev/null
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --upgrade pip
"$work/venv/bin/python" -m pip install --quiet "torch==2.13.0"
"$work/venv/bin/python" -m pip install --quiet -c ci/constraints.txt "${wheel}[hf]"
cd "$work"  # nothing of the checkout on the path from here
"$work/venv/bin/python" - "$root" <<'PY'
import sys

import dropbp
import dropbp.backends

assert not dropbp.__file__.startswith(sys.argv[1]), dropbp.__file__
assert dropbp.backends.get("cpu").name == "cpu"
print("installed wheel:", dropbp.__version__, "from", dropbp.__file__)
PY
"$work/venv/bin/dropbp" check --backend cpu --quick --out "$work/check" >"$work/check.log" 2>&1 \
  || { cat "$work/check.log"; echo "ci/wheel.sh: dropbp check failed in the installed wheel" >&2; exit 1; }
tail -n 3 "$work/check.log"
echo "ci/wheel.sh: the wheel installs and runs: $(basename "$wheel")"
