"""CPU step-time benchmark: DropBP against the same model without the library.

A ~30M-parameter Llama-architecture model (random weights), full fine-tuning and LoRA. In one
process, interleaved round by round, it trains ONE model and times each training step (forward,
backward, AdamW step) of
  - the baseline: the model with no library attached,
  - the same model with dropbp attached at drop rates 0, 0.5 and 0.875 (attached and removed
    outside the timed region),
and, to state the ideal, the forward (F), backward (B) and optimizer (O) phases of the baseline and
the backward and optimizer step with every branch dropped (B0, O0; dropped parameters get no
gradient, so AdamW skips them). Ideal step time at rate p: F + B0 + O0 + (1 - p)(B - B0 + O - O0);
efficiency = ideal / measured. Speedups and overhead are medians over rounds of the per-round
ratio (each round times every configuration once, in rotating order), so machine drift cancels.

    python benchmarks/step_time.py                 # ~10 minutes on 2 cores
    python benchmarks/step_time.py --rounds 3      # a quick look
Writes benchmarks/results/step_time_cpu.json and .md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch
import transformers
from torch import nn

import dropbp
from dropbp.execution import attach_no_grad_hooks

RATES = (0.0, 0.5, 0.875)
RESULTS = Path(__file__).resolve().parent / "results"


def build_model(seed: int = 0) -> nn.Module:
    config = transformers.AutoConfig.for_model(
        "llama",
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=8192,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()


def prepare(model: nn.Module, method: str) -> nn.Module:
    if method == "lora":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    return model.train()


class Trainer:
    """One model and its optimizer, trained by every configuration in turn.

    Sharing one model means the baseline and DropBP run on the very same tensors: only the library
    differs. Attaching and detaching happen outside the timed region.
    """

    def __init__(self, model: nn.Module, seq_len: int) -> None:
        self.model = model
        self.seq_len = seq_len
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        probe = dropbp.apply(model, 0.0)
        self.branch_modules = [b.module for b in probe.branches]
        probe.remove()

    def attach(self, config: str) -> object:
        """Attach what ``config`` needs; returns what to remove afterwards."""
        if config == "baseline":
            return []
        if config == "all_dropped":  # B0: every branch without autograd (more than dropbp ever drops)
            return [h for m in self.branch_modules for h in attach_no_grad_hooks(m, lambda: True)]
        rate = float(config.split("@")[1])
        ctl = dropbp.apply(self.model, 0.0, seq_len=self.seq_len)
        ctl.set_rates([rate] * len(ctl.branches))
        return [ctl]

    def step(self, ids: torch.Tensor) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        loss = self.model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        if loss.requires_grad:  # with LoRA and every branch dropped nothing is trainable
            loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2


def run_method(method: str, rounds: int, warmup: int, batch: int, seq: int) -> dict:
    trainer = Trainer(prepare(build_model(), method), seq)
    model = trainer.model
    configs = ["baseline", "all_dropped", *[f"dropbp@{r}" for r in RATES]]
    times: dict[str, list[tuple[float, float, float]]] = {c: [] for c in configs}
    g = torch.Generator().manual_seed(0)
    for rnd in range(warmup + rounds):
        ids = torch.randint(0, 8192, (batch, seq), generator=g)
        shift = rnd % len(configs)
        for name in configs[shift:] + configs[:shift]:
            attached = trainer.attach(name)
            t = trainer.step(ids)
            for handle in attached:
                handle.remove()
            if rnd >= warmup:
                times[name].append(t)
        print(f"{method} round {rnd + 1}/{warmup + rounds}", flush=True)

    def phase(config: str, i: int) -> float:
        return statistics.median(t[i] for t in times[config])

    total = {c: [sum(t) for t in times[c]] for c in configs}
    med = {c: statistics.median(total[c]) for c in configs}
    f, b, o = (phase("baseline", i) for i in range(3))
    b0, o0 = phase("all_dropped", 1), phase("all_dropped", 2)
    rows = []
    for r in RATES:
        name = f"dropbp@{r}"
        # dropped parameters get no gradient, so the optimizer skips them too: scale B and O alike
        ideal = f + b0 + o0 + (1 - r) * (b - b0 + o - o0)
        paired = [base / mine for base, mine in zip(total["baseline"], total[name], strict=True)]
        rows.append(
            {
                "drop_rate": r,
                "step_s": med[name],
                "speedup": statistics.median(paired),
                "speedup_range": [min(paired), max(paired)],
                "ideal_step_s": ideal,
                "ideal_speedup": med["baseline"] / ideal,
                "efficiency": ideal / med[name],
            }
        )
    return {
        "method": method,
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "branches": len(trainer.branch_modules),
        "baseline_step_s": med["baseline"],
        "forward_s": f,
        "backward_s": b,
        "backward_all_dropped_s": b0,
        "optimizer_s": o,
        "optimizer_all_dropped_s": o0,
        "overhead_at_rate_0": 1 / rows[0]["speedup"] - 1,
        "hook_cost_per_step_s": hook_cost_per_step(len(trainer.branch_modules) // 2),
        "rows": rows,
    }


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
        lines.append(f"| {m['method']} | baseline (no library) | {m['baseline_step_s']:.3f} | 1.00x | | |")
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
            f"{hooks * 1e6:.0f} us per step = {100 * hooks / m['baseline_step_s']:.3f}% of a step; "
            f"F={m['forward_s']:.3f}s B={m['backward_s']:.3f}s "
            f"B0={m['backward_all_dropped_s']:.3f}s O={m['optimizer_s']:.3f}s "
            f"O0={m['optimizer_all_dropped_s']:.3f}s"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
