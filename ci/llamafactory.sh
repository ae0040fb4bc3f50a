#!/usr/bin/env bash
# Runs tests/test_llamafactory.py (the README's recipes: run_exp(args, callbacks=[DropBPCallback(...)]) and
# `dropbp llamafactory train.yaml`) and the YAML command's own tests against LLaMA-Factory itself, in an
# environment of its own (default .venv-llamafactory; LLAMAFACTORY_VENV=path to use another).
# Not part of ci/test.sh: LLaMA-Factory 0.9.5 pins transformers <= 5.6, peft <= 0.18.1 and
# accelerate <= 1.11, older than dropbp's hf extra asks for, so it cannot share .venv. Its torchvision and
# torchaudio pins bring their own torch (2.14.1 with CUDA packages, about 6.6 GB in all): PyPI's torchvision and
# torchaudio wheels do not load beside this machine's CPU-only torch 2.13.0, and LLaMA-Factory imports both.
# About 5 minutes here. dropbp goes in without the hf extra, on LLaMA-Factory's own versions. Extra arguments go
# to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${LLAMAFACTORY_VENV:-.venv-llamafactory}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install --quiet "llamafactory==0.9.5"
python -m pip install --quiet -e ".[test]"
python -c "import llamafactory, transformers, peft, torch; print('llamafactory', llamafactory.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__, '| torch', torch.__version__)"
python -m pytest tests/test_llamafactory.py tests/test_llamafactory_config.py "$@"
