"""CPU step-time benchmark: DropBP against the same model without the library.

``dropbp bench``'s measurement (``dropbp/tools/bench.py``) of its "small" preset, a ~34M-parameter
Llama-architecture model (8 layers, hidden 512, random weights), full fine-tuning and LoRA: one model
trained by every configuration in turn, round by round in rotating order (no library; the library at
drop rates 0, 0.5, 0.875; every branch without autograd for the ideal), forward, backward and
optimizer phases timed separately. Ideal step time at rate p: F + B0 + O0 + (1 - p)(B - B0 + O - O0);
efficiency = ideal / measured; speedups are medians of per-round ratios, so machine drift cancels.
Added here: the library's own cost per step at drop rate 0, measured alone (see hook_cost_per_step).

    python benchmarks/step_time.py                 # ~3 minutes on 2 cores
    python benchmarks/step_time.py --rounds 5      # a quick look
Writes benchmarks/results/step_time_cpu.json and .md.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import torch
import transformers
from torch import nn

import dropbp
from dropbp import backends
from dropbp.tools.bench import Point, measure

RATES = (0.0, 0.5, 0.875)
RESULTS = Path(__file__).resolve().parent / "results"


def run_method(method: str, rounds: int, warmup: int, batch: int, seq: int) -> dict:
    """``dropbp bench``'s measurement of the "small" preset, plus the library's hook cost alone."""
    point = measure(Point("small", method, seq, batch), RATES, backends.get("cpu"), torch.float32, rounds, warmup)
    rate0 = point["rows"][0]
    point["overhead_at_rate_0"] = 1 / rate0["speedup"] - 1
    point["hook_cost_per_step_s"] = hook_cost_per_step(point["branches"] // 2)
    return point


class _EmptyBlock(nn.Module):
    """A decoder layer shape whose branches do no work: its forward is pure module-call overhead."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = nn.Identity()
        self.mlp = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(x)
        return x + self.mlp(x)


def hook_cost_per_step(layers: int, blocks: int = 30, per_block: int = 2000) -> float:
    """Seconds the library adds to one training forward at drop rate 0, measured where nothing hides
    it: the same number of layers with branches that do no work. The library's cost is Python (one
    model hook, two hooks per branch) and does not depend on tensor sizes, so this measures it far
    more precisely than the noisy 0.5 s steps can. Blocks alternate with and without the library;
    the fastest block of each (timeit's estimator) is the least disturbed by other work."""
    model = nn.Sequential(*[_EmptyBlock() for _ in range(layers)]).train()
    model.register_parameter("unused", nn.Parameter(torch.zeros(1)))  # apply refuses a model with nothing to train
    names = [f"{i}.{child}" for i in range(layers) for child in ("self_attn", "mlp")]
    x = torch.zeros(1, requires_grad=True)
    per_forward: dict[bool, list[float]] = {False: [], True: []}
    for block in range(blocks):
        with_library = block % 2 == 1
        ctl = dropbp.apply(model, 0.0, branches=names) if with_library else None
        t0 = time.perf_counter()
        for _ in range(per_block):
            model(x)
        per_forward[with_library].append((time.perf_counter() - t0) / per_block)
        if ctl is not None:
            ctl.remove()
    return min(per_forward[True]) - min(per_forward[False])


def markdown(results: dict) -> str:
    lines = [
        f"CPU step time, Llama-architecture ~{results['methods'][0]['parameters'] / 1e6:.0f}M parameters, "
        f"batch {results['batch']} x sequence {results['seq_len']}, {results['rounds']} interleaved rounds "
        f"(torch {results['torch']}, {results['threads']} threads, {results['date']}).",
        "",
        "| method | drop rate | step (s) | speedup vs no library | ideal speedup | efficiency |",
        "|---|---|---|---|---|---|",
    ]
    for m in results["methods"]:
        lines.append(f"| {m['method']} | baseline (no library) | {m['baseline']['step_s']:.3f} | 1.00x | | |")
        for r in m["rows"]:
            lines.append(
                f"| {m['method']} | {r['drop_rate']} | {r['step_s']:.3f} | {r['speedup']:.3f}x | "
                f"{r['ideal_speedup']:.2f}x | {r['efficiency']:.2f} |"
            )
    lines.append("")
    for m in results["methods"]:
        hooks = m["hook_cost_per_step_s"]
        lines.append(
            f"- {m['method']}: library overhead at drop rate 0 = {100 * m['overhead_at_rate_0']:+.2f}% "
            f"(median of per-round ratios, within the machine's noise); hook cost measured alone "
            f"{hooks * 1e6:.0f} us per step = {100 * hooks / m['baseline']['step_s']:.3f}% of a step; "
            f"F={m['baseline']['forward_s']:.3f}s B={m['baseline']['backward_s']:.3f}s "
            f"B0={m['all_dropped']['backward_s']:.3f}s O={m['baseline']['optimizer_s']:.3f}s "
            f"O0={m['all_dropped']['optimizer_s']:.3f}s"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30, help="best a multiple of 5")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--methods", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    results = {
        "benchmark": "step_time_cpu",
        "date": date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "seq_len": args.seq_len,
        "rounds": args.rounds,
        "methods": [run_method(m, args.rounds, args.warmup, args.batch, args.seq_len) for m in args.methods],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_time_cpu.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    (args.out / "step_time_cpu.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
