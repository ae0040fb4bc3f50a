"""The host work a token-dropped step adds: aten operations per training step, counted (issue 49).

On a GPU where the host bounds a step (docs/token-drops.md, "On a GPU"), a step's time follows the operations the
host dispatches, not the arithmetic. Their count does not depend on the hardware or on the machine's load, so it is
counted here on the CPU: SmolLM2-135M's shape (random weights), one sequence of 64 tokens, full backprop against
token drops at 0.5 and ``token_drop_rate="auto"``, LoRA and full fine-tuning, fp32 and bf16 autocast. Counted: the
top-level aten operations of one profiled step after two unprofiled ones (an operation another aten operation calls
is not counted again).

    python benchmarks/token_op_count.py --out benchmarks/results/token_op_count
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
import transformers
from torch.profiler import profile

import dropbp
from dropbp.tools.pretrained import load_causal_lm
from dropbp.tools.qlora import with_lora

ARMS = (("full backprop", 0.0), ("token drops 0.5", 0.5), ('token drops "auto"', "auto"))


def _count(method: str, bf16: bool, config: transformers.PretrainedConfig) -> dict[str, collections.Counter]:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model = (with_lora(model) if method == "lora" else model).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (1, 64))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    ctl = dropbp.apply(model, 0.0, seed=0, features=[dropbp.experimental.TokenDrops(0.5)])
    counts = {}
    for arm, rate in ARMS:
        ctl.features["token_drops"].rate = rate
        step()
        step()
        with profile() as prof:
            step()
        top = [
            e.name
            for e in prof.events()
            if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
        ]
        counts[arm] = collections.Counter(top)
    ctl.remove()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = load_causal_lm()[0].config
    branches = 2 * config.num_hidden_layers
    rows, lines = [], []
    for method in ("lora", "full"):
        for bf16 in (False, True):
            counts = _count(method, bf16, config)
            full = counts["full backprop"]
            for arm, _ in ARMS:
                extra = counts[arm] - full
                row = {
                    "method": method,
                    "precision": "bf16 autocast" if bf16 else "fp32",
                    "arm": arm,
                    "ops": sum(counts[arm].values()),
                    "extra_per_branch": round((sum(counts[arm].values()) - sum(full.values())) / branches, 1),
                    "most_added": extra.most_common(8),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ops.json").write_text(json.dumps({"branches": branches, "rows": rows}, indent=1) + "\n")
    lines = [
        f"Top-level aten operations per training step, SmolLM2-135M's shape (random weights, {branches} branches), "
        "1 x 64 tokens, counted on the CPU with torch.profiler (benchmarks/token_op_count.py).",
        "",
        "| method | precision | arm | operations a step | added per branch | most added |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        added = ", ".join(f"{name.removeprefix('aten::')} {n}" for name, n in r["most_added"][:5])
        lines.append(
            f"| {r['method']} | {r['precision']} | {r['arm']} | {r['ops']} | {r['extra_per_branch']} | {added} |"
        )
    (args.out / "ops.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
