#!/usr/bin/env bash
# README's install lines, read from its table and run verbatim in a fresh clone of this commit, each in a fresh
# environment: the line for NVIDIA GPUs, Intel GPUs and CPUs, then the dropbp part of the Gaudi line (what follows
# its `&&`; Gaudi's container brings its own torch, which torch 2.13.0, installed first, stands in for: "bring your
# own torch"). The first then trains a step of a tiny Llama with DropBP, the second imports dropbp without any
# dependency installed and names what the hpu backend lacks here. ci/test.sh runs it after ci/wheel.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git clone --quiet . "$work/clone"

readme_line() {  # the command in README's install table for the machine whose name starts with $1
  python3 - "$1" <<'PY'
import re
import sys

rows = re.findall(r"^\| (.+?) \| `(.+)` \|$", open("README.md", encoding="utf-8").read(), flags=re.M)
found = [command for machine, command in rows if machine.startswith(sys.argv[1])]
if len(found) != 1:
    sys.exit(f"ci/install-lines.sh: README's install table has {len(found)} lines for {sys.argv[1]!r}")
print(found[0])
PY
}

fresh_env() {  # a fresh virtual environment at $1 with torch 2.13.0 (the CPU wheel), activated
  python3 -m venv "$1"
  . "$1/bin/activate"
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet "torch==2.13.0"
}

cpu=$(readme_line "NVIDIA GPU, Intel GPU, CPU")
gaudi=$(readme_line "Intel Gaudi2")
gaudi=${gaudi##*&& }

fresh_env "$work/cpu"
echo "ci/install-lines.sh: $cpu"
(cd "$work/clone" && eval "$cpu") >"$work/cpu.log" 2>&1 || { cat "$work/cpu.log"; exit 1; }
cd "$work"
python - <<'PY'
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import dropbp

config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM(config)
ctl = dropbp.apply(model, drop_rate=0.5, seed=0)
ids = torch.randint(0, 64, (2, 16))
model(input_ids=ids, labels=ids).loss.backward()
print("installed with README's line:", dropbp.__version__, "| branches dropped in a step:", len(ctl.last_dropped))
PY
deactivate
rm -rf "$work/cpu"  # CI's disk can be small: one environment at a time

fresh_env "$work/gaudi"
echo "ci/install-lines.sh: $gaudi"
(cd "$work/clone" && eval "$gaudi") >"$work/gaudi.log" 2>&1 || { cat "$work/gaudi.log"; exit 1; }
DROPBP_BACKEND=hpu python - <<'PY'
import importlib.metadata

import dropbp
import dropbp.backends

assert {d.metadata["Name"] for d in importlib.metadata.distributions()} >= {"dropbp", "torch"}
assert importlib.util.find_spec("transformers") is None  # --no-deps: nothing but dropbp beside the torch there
try:
    dropbp.backends.get()
except Exception as error:  # no Gaudi stack here: the message says what is missing
    assert "habana_frameworks" in str(error), error
    print("installed with the Gaudi line's dropbp part:", dropbp.__version__, "| hpu here:", str(error)[:90], "...")
else:
    raise AssertionError("the hpu backend loaded without a Gaudi stack")
PY
deactivate
echo "ci/install-lines.sh: README's install lines install and run"
