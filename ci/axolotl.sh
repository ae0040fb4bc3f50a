#!/usr/bin/env bash
# Runs tests/test_axolotl.py against axolotl itself, in an environment of its own (default .venv-axolotl;
# AXOLOTL_VENV=path to use another). Not part of ci/test.sh: axolotl 0.19.0 pins transformers 5.16.1,
# peft 0.20.0 and accelerate 1.13.0, older than dropbp's hf extra asks for, so it cannot share .venv;
# and it installs ~200 packages (triton, xformers, bitsandbytes, gradio, ...): about 10 minutes here.
# dropbp goes in without the hf extra, on axolotl's transformers and peft. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${AXOLOTL_VENV:-.venv-axolotl}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet "axolotl==0.19.0"
python -m pip install --quiet -e ".[test]"
python -c "import axolotl.integrations.base, transformers, peft; print('axolotl', axolotl.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__)"
python -m pytest tests/test_axolotl.py "$@"
