#!/usr/bin/env bash
# The second test environment, .venv-litgpt: litgpt 0.5 pins huggingface-hub<1.4, which transformers
# 5 cannot import with, so litgpt is tested beside transformers 4.57 (its newest release below 5).
# torch==2.13.0 first, as in ci/install.sh: the CPU wheel, no CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-litgpt
. .venv-litgpt/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[litgpt]" "transformers>=4.57,<4.58" "peft>=0.17,<1" "pytest>=8,<10"
python -c "import torch, transformers, litgpt, dropbp; print('installed (.venv-litgpt): torch', torch.__version__, '| transformers', transformers.__version__, '| litgpt', __import__('importlib.metadata').metadata.version('litgpt'))"
