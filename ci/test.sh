#!/usr/bin/env bash
# The test command (README "Quick start", line 2; .ci/run runs exactly this): set up .venv if needed,
# then lint and run the CPU test suite (two processes, pytest-xdist). Extra arguments go to pytest instead (one
# process; `-m fast`: the fast tier, CONTRIBUTING.md). Fails loudly if no test ran. With no arguments it then builds
# the documentation site strictly (mkdocs.yml: broken links, the API reference from the docstrings).
# Then it runs the litgpt tests, and the gradient and hf integration tests again, in the second
# environment, .venv-litgpt (litgpt and the lowest transformers / accelerate / peft the hf extra declares: see
# ci/install-litgpt.sh), then builds the wheel and tests it installed (ci/wheel.sh), and runs README's install lines
# in a fresh clone (ci/install-lines.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
# Tiny models: one intra-op thread is as fast, and OpenMP threads never spin against other processes
# (on a busy 2-core machine they made the suite 10-50x slower).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
free_disk() { df -Ph . | awk 'NR == 2 {print "disk free here: " $4 " of " $2}'; }
echo "ci/test.sh: $(free_disk)"  # an install that fails with "No space left on device" reads against this
if [ ! -x .venv/bin/ruff ] || [ ! -x .venv/bin/dropbp ] || [ ! -x .venv/bin/mkdocs ] || { [ ! -x .venv/bin/ds_report ] && [ ! -f .venv/deepspeed-unavailable ]; }; then
  bash ci/install.sh || { echo "ci/test.sh: setting up .venv failed (see above) | $(free_disk)" >&2; exit 1; }
fi
. .venv/bin/activate
ruff check . || { echo "ci/test.sh: ruff found problems (listed above)" >&2; exit 1; }

run_pytest() {  # pytest exits 5 when it ran nothing: a failure, not a pass
  "$@"
  local rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "ci/test.sh: pytest ran no tests - that is a failure, not a pass" >&2
    return 1
  fi
  return "$rc"
}

[ "$#" -gt 0 ] && { run_pytest python -m pytest "$@"; exit $?; }
run_pytest python -m pytest -n "${DROPBP_TEST_WORKERS:-2}" || exit $?
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet || { echo "ci/test.sh: the docs site did not build (above)" >&2; exit 1; }
deactivate
if [ ! -x .venv-litgpt/bin/litgpt ]; then
  bash ci/install-litgpt.sh || { echo "ci/test.sh: setting up .venv-litgpt failed (see above) | $(free_disk)" >&2; exit 1; }
fi
run_pytest .venv-litgpt/bin/python -m pytest -p no:cacheprovider tests/test_litgpt.py tests/test_layouts.py \
  tests/test_gradients.py tests/test_hf_integration.py tests/test_wrappers.py tests/test_chunked_loss.py || exit $?
if [ -n "${CI:-}" ]; then  # CI's disk can be small: the next two steps each make environments of their own
  rm -rf .venv-litgpt && echo "ci/test.sh: removed .venv-litgpt (CI is set) | $(free_disk)"
fi
# The release artefacts: the wheel built, installed in a fresh environment and run there (no checkout in sight);
# then README's install lines, verbatim, in a fresh clone and fresh environments.
bash ci/wheel.sh || exit $?
bash ci/install-lines.sh
