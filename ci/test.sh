#!/usr/bin/env bash
# The test command (README "Tests"): lint, then the CPU test suite. Fails loudly if no test ran.
set -uo pipefail
cd "$(dirname "$0")/.."
ruff check . || { echo "ci/test.sh: ruff found problems" >&2; exit 1; }
python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "ci/test.sh: pytest ran no tests - that is a failure, not a pass" >&2
  exit 1
fi
exit "$rc"
