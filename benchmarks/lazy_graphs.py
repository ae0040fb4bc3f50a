"""Graphs Gaudi's lazy mode compiles for the shipped default, measured on PyTorch's own lazy-tensor engine.

The HPU backend runs in lazy mode on ``torch._lazy`` (TorchScript backend, CPU; :mod:`dropbp.backends.lazy`):
a graph break after each backward and after each optimizer step, and its pattern bound (16). The model has
SmolLM2-135M's layout (30 Llama layers: 60 branches) at a tiny width: the count of graphs depends on the patterns,
not on the width. A hand loop with ``ctl.backward`` / ``ctl.optimizer_step`` and SGD with momentum (one update
graph per step, as Habana's FusedAdamW). Each configuration is set as ``attach`` sets a Trainer's run: the time
schedule over the run's training forwards and the longest warm-up up to 20% that the drop rate can pay for.
Reported: the training graphs compiled at the breaks (the model's own early graphs, from ops the engine runs
eagerly, are counted apart), what ``ctl.pattern_plan`` predicted before the run, and the last step that compiled.

    python benchmarks/lazy_graphs.py                         # 1000 steps, 0.5 and 0.875, one micro-batch

    python benchmarks/lazy_graphs.py --steps 250 --micro-batches 8 --tag accumulate8

Writes benchmarks/results/lazy_graphs[_<tag>].{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from datetime import date
from pathlib import Path

import torch
import transformers
from dropbp.backends.lazy import LazyEngineBackend, compiled_graphs, start

import dropbp
from dropbp.integrations.hf import fit_auto_warmup

RESULTS = Path(__file__).resolve().parent / "results"


def smollm2_layout(vocab: int, width: int = 32, layers: int = 30) -> torch.nn.Module:
    """SmolLM2-135M's depth (30 layers, 60 branches) at a tiny width; ``vocab`` keeps each run's graphs its own."""
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()


def measure(pattern: str, rate: float, micro_batches: int, steps: int, vocab: int) -> dict:
    backend = LazyEngineBackend()
    model = smollm2_layout(vocab).to("lazy")
    # The memory bound (on from 0.75) runs layers through torch.utils.checkpoint, which saves the RNG state of a
    # torch.<device> module: Gaudi has torch.hpu, the engine has no torch.lazy. Off here; it recomputes the layers
    # its pattern selects, so it changes a pattern's graph, not how many patterns there are.
    ctl = dropbp.apply(model, rate, seed=0, pattern=pattern, memory_bound=False, backend=backend)
    fit_auto_warmup(ctl, steps * micro_batches)  # attach's warmup="auto"
    torch._lazy.mark_step()  # the set-up's own graph
    plan = ctl.schedule.patterns(micro_batches=micro_batches)
    at_breaks = [0]
    graph_break = backend.graph_break

    def counted() -> None:
        before = compiled_graphs()
        graph_break()
        at_breaks[0] += compiled_graphs() - before

    backend.graph_break = counted
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    start_all, started = compiled_graphs(), time.perf_counter()
    per_step = []
    for step in range(steps):
        for _ in range(micro_batches):
            ids = torch.randint(3, vocab, (1, 16), generator=generator).to("lazy")
            ctl.backward(model(input_ids=ids, labels=ids).loss / micro_batches)
        ctl.optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        per_step.append(at_breaks[0])
        if (step + 1) % max(1, steps // 10) == 0:
            print(f"  {pattern} {rate} x{micro_batches}: step {step + 1}, {at_breaks[0]} graphs", file=sys.stderr)
    last = max((i + 1 for i in range(steps) if per_step[i] != (per_step[i - 1] if i else 0)), default=0)
    return {
        "pattern": pattern,
        "drop_rate": rate,
        "micro_batches": micro_batches,
        "steps": steps,
        "warmup_steps": ctl.warmup_steps,
        "training_graphs": at_breaks[0],
        "model_own_graphs": compiled_graphs() - start_all - at_breaks[0],
        "graphs_by_quarter": [per_step[steps * q // 4 - 1] for q in (1, 2, 3, 4)],
        "last_step_that_compiled": last,
        "plan": {**plan.__dict__, "graphs": plan.graphs},
        "seconds": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 0.875])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1])
    parser.add_argument("--patterns", nargs="+", default=["cut", "uniform"])
    parser.add_argument("--tag", default="", help="appended to the output file names")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    stem = "lazy_graphs" + (f"_{args.tag}" if args.tag else "")
    start()
    rows = []
    vocab = 128
    for micro_batches in args.micro_batches:
        for pattern in args.patterns:
            for rate in args.rates:
                rows.append(measure(pattern, rate, micro_batches, args.steps, vocab))
                vocab += 1
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    record = {
        "benchmark": "lazy_graphs",
        "date": date.today().isoformat(),
        "command": "python " + shlex.join(sys.argv),
        "torch": torch.__version__,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "Graphs compiled on PyTorch's lazy-tensor engine (torch._lazy, TorchScript backend, CPU) by the HPU backend's "
        "lazy mode, pattern bound 16; SmolLM2-135M's layout (30 layers, 60 branches) at a tiny width, full "
        "fine-tuning, SGD with momentum, attach's schedule (time schedule, warm-up up to 20%), memory bound off "
        f"(see the script); torch {torch.__version__}, {record['date']}. Not measured on Gaudi: the engine shares "
        "lazy mode's design (a graph per distinct sequence of ops, cached), not its compiler.",
        f"Command: `{record['command']}`",
        "",
        "| pattern | drop rate | micro-batches | steps | warm-up (forwards) | training graphs | predicted "
        "(`ctl.schedule.patterns().graphs`) | distinct patterns | by 25/50/75/100% of the run | "
        "last step that compiled | plan settled at | model's own graphs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["plan"]
        lines.append(
            f"| {r['pattern']} | {r['drop_rate']} | {r['micro_batches']} | {r['steps']} | {r['warmup_steps']} | "
            f"{r['training_graphs']} | {p['graphs']} | {p['patterns']} | "
            f"{' / '.join(str(x) for x in r['graphs_by_quarter'])} | {r['last_step_that_compiled']} | "
            f"{p['settled_at']} | {r['model_own_graphs']} |"
        )
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
