#!/usr/bin/env bash
# The test command (README "Quick start", line 2; .ci/run runs exactly this): set up .venv if needed,
# then lint and run the CPU test suite. Extra arguments go to pytest. Fails loudly if no test ran.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/ruff ] || [ ! -x .venv/bin/dropbp ]; then
  bash ci/install.sh || { echo "ci/test.sh: setting up .venv failed (see above)" >&2; exit 1; }
fi
. .venv/bin/activate
ruff check . || { echo "ci/test.sh: ruff found problems (listed above)" >&2; exit 1; }
python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "ci/test.sh: pytest ran no tests - that is a failure, not a pass" >&2
  exit 1
fi
exit "$rc"
