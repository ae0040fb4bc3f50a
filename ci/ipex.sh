#!/usr/bin/env bash
# The CPU backend against the real Intel Extension for PyTorch, in an environment of its own (default
# .venv-ipex; IPEX_VENV=path to use another). NOT run in CI nor by ci/test.sh: it is heavy and its torch
# is older than dropbp supports. Results: benchmarks/results/ipex_cpu/README.md.
#
# Why its own environment: IPEX's last release, 2.8.0, pins torch 2.8, and dropbp declares torch>=2.11,
# so dropbp goes in with --no-deps (its only dependency is torch); the declared support stays >=2.11,
# this is one run of the tests on 2.8, not a promise. The CPU-only torch wheel
# (download.pytorch.org/whl/cpu) was not reachable where this was written, so torch 2.8.0 comes from
# PyPI with its CUDA packages (~3 GB, ~6 GB installed); IPEX is a ~50 MB wheel. transformers 5.23 needs
# torch>=2.6, peft 0.21.2 torch>=1.13: the versions of .venv, which satisfy dropbp's hf extra.
#
# It then runs the IPEX tests (tests/test_ipex.py: the real ipex.optimize under DROPBP_BACKEND=cpu,
# exact gradients and updates vs the hand-detached reference under bf16 autocast), the backend tests
# (IPEX logic and the example script, which now optimizes with the real IPEX) and the gradient tests.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
VENV="${IPEX_VENV:-.venv-ipex}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install --quiet --progress-bar off "torch==2.8.0" "intel-extension-for-pytorch==2.8.0" \
  "transformers==5.23.0" "peft==0.21.2" "accelerate==1.15.0" "pytest>=8.2,<10" numpy
python -m pip install --quiet --progress-bar off --no-deps -e .  # torch>=2.11 declared: see above
# One line of versions; importing IPEX prints torch's kernel-override warnings to stderr, hence 2>/dev/null.
python -c "import torch, intel_extension_for_pytorch as ipex, transformers, peft; print('torch', torch.__version__, '| intel_extension_for_pytorch', ipex.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__)" 2>/dev/null
python -m pytest -p no:cacheprovider -rfEs tests/test_ipex.py tests/test_backends.py tests/test_gradients.py "$@"
