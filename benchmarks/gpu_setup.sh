#!/usr/bin/env bash
# Sourced by the GPU scripts (gpu_tokens.sh, gpu_core.sh) on a lent machine: installs this checkout, records the
# device in $RESULTS/device.txt, saves SmolLM2's shape with random weights at /tmp/smollm2-random (from its config.json
# in $SMOL_CONFIG: the pretrained file is too large to carry, and a step's time does not depend on the weights), and
# defines pack (a tarball of $RESULTS into $OUT after every stage: what a killed call still returns).
: "${SMOL_CONFIG:?}" "${RESULTS:?}" "${OUT:?}"
export PYTHONUNBUFFERED=1 DROPBP_CACHE=/root/dropbp-cache
mkdir -p "$RESULTS"
pack() { tar czf "$OUT/results.tgz" -C "$RESULTS" . ; echo "== $1 done $(date +%T)"; }
# installed, and run with -P: the checkout's dropbp/ lacks backends/ (pyproject maps it in), so it must not shadow
python3 -m pip install -q --no-deps --no-build-isolation . || exit 1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
} | tee "$RESULTS/device.txt"
python3 - "$SMOL_CONFIG" /tmp/smollm2-random <<'PY'
import sys, torch, transformers
config = transformers.AutoConfig.from_pretrained(sys.argv[1])
torch.manual_seed(0)
transformers.AutoModelForCausalLM.from_config(config).save_pretrained(sys.argv[2])
PY
