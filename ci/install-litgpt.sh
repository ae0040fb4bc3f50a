#!/usr/bin/env bash
# The second test environment, .venv-litgpt: litgpt 0.5, and the lowest versions dropbp's hf extra declares
# (transformers 4.55, accelerate 1.7, peft 0.17: optimum-habana 1.20's transformers and accelerate, so what Gaudi
# users run is tested), with trl 0.19. litgpt 0.5 pins huggingface-hub<1.4, which transformers 5 cannot import with,
# so it lives here, beside transformers 4.x.
# torch==2.13.0 first, as in ci/install.sh: the CPU wheel, no CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-litgpt
. .venv-litgpt/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[litgpt]" "transformers>=4.55,<4.56" "accelerate==1.7.0" "peft==0.17.0" \
  "trl>=0.19,<0.20" "datasets>=2.19" "pytest>=8,<10"
python -c "import torch, transformers, accelerate, peft, litgpt, dropbp; print('installed (.venv-litgpt): torch', torch.__version__, '| transformers', transformers.__version__, '| accelerate', accelerate.__version__, '| peft', peft.__version__, '| litgpt', __import__('importlib.metadata').metadata.version('litgpt'))"
