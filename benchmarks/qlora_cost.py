"""Where 4-bit weights enter DropBP's cost model: LoRA and QLoRA (nf4) on the same model, paired.

The same preset is built twice, as ``lora`` and as ``qlora`` (``dropbp bench``'s builders: the same
random weights and the same adapters; QLoRA's base weights are nf4 4-bit). Every round times, in
rotating order, one training step of each (forward F, backward B, optimizer O), the same step with
every branch dropped (B0), and dequantising every 4-bit weight once (D). Differences are medians of
per-round differences, so a busy machine's drift cancels as far as it can.

The first-order model: a 4-bit forward dequantises every weight (+D, dropped branches included); a
backward that needs a layer's input gradient dequantises it again (MatMul4Bit.backward), which a
dropped branch skips, so the droppable part also grows by about D. Hence, at drop rate p,

    F_q ~ F_l + D,   B_q - B0_q ~ (B_l - B0_l) + D_kept,   D_kept <= D

(D_kept leaves out the layers whose input needs no gradient: the first layer's q, k and v read the
frozen embeddings through a frozen norm). Writes ``<out>/qlora_cost.json`` and ``.md``.

    OMP_NUM_THREADS=1 python benchmarks/qlora_cost.py --preset small --rounds 15
    OMP_NUM_THREADS=1 python benchmarks/qlora_cost.py --preset smollm2 --rounds 10
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import date
from pathlib import Path

import torch
import transformers

from dropbp import backends
from dropbp.tools.bench import _Bench, build_model
from dropbp.tools.compare import timing_verdict

RESULTS = Path(__file__).resolve().parent / "results"


def measure(preset: str, seq_len: int, batch_size: int, rounds: int, warmup: int) -> dict:
    backend = backends.get("cpu")
    benches = {
        m: _Bench(build_model(preset, m, seq_len, torch.float32, backend.device), backend, seq_len)
        for m in ("lora", "qlora")
    }
    configs = [(m, c) for m in benches for c in ("baseline", "all_dropped")] + [("qlora", "dequantize")]
    times: dict[tuple[str, str], list] = {c: [] for c in configs}
    vocab = benches["lora"].model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    for rnd in range(warmup + rounds):
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
        shift = rnd % len(configs)
        for method, config in configs[shift:] + configs[:shift]:
            bench = benches[method]
            if config == "dequantize":
                t = bench.dequantize()
            else:
                handles = bench.attach(config, rnd)
                t = bench.step(ids)
                for h in handles:
                    h.remove()
            if rnd >= warmup:
                times[(method, config)].append(t)

    def med(method: str, config: str, phase: int) -> float:
        return statistics.median(t[phase] for t in times[(method, config)])

    def paired(phase: int, config: str = "baseline") -> float:
        return statistics.median(
            q[phase] - x[phase] for q, x in zip(times[("qlora", config)], times[("lora", config)], strict=True)
        )

    d = statistics.median(times[("qlora", "dequantize")])
    phases = {
        m: {
            "forward_s": med(m, "baseline", 0),
            "backward_s": med(m, "baseline", 1),
            "optimizer_s": med(m, "baseline", 2),
            "backward_all_dropped_s": med(m, "all_dropped", 1),
            "step_s": statistics.median(sum(t) for t in times[(m, "baseline")]),
        }
        for m in benches
    }
    return {
        "benchmark": "qlora_cost",
        "date": date.today().isoformat(),
        "preset": preset,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "rounds": rounds,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "four_bit_layers": len(benches["qlora"].four_bit),
        "phases": phases,
        "dequantize_s": d,
        "qlora_minus_lora": {
            "forward_s": paired(0),
            "backward_s": paired(1),
            "backward_all_dropped_s": paired(1, "all_dropped"),
            "optimizer_s": paired(2),
        },
        "timing": {m: timing_verdict([sum(t) for t in times[(m, "baseline")]]) for m in benches},
        "rounds_raw": {f"{m}/{c}": v for (m, c), v in times.items()},
    }


def markdown(r: dict) -> str:
    lo, q, diff, d = r["phases"]["lora"], r["phases"]["qlora"], r["qlora_minus_lora"], r["dequantize_s"]
    lines = [
        f"LoRA against QLoRA (nf4) on the `{r['preset']}` preset, batch {r['batch_size']} x {r['seq_len']}, "
        f"{r['rounds']} paired rounds, CPU, {r['threads']} threads, torch {r['torch']} ({r['date']}); "
        f"{r['four_bit_layers']} 4-bit layers.",
        "",
        "| phase | LoRA (s) | QLoRA (s) | QLoRA - LoRA, paired (s) | in units of D |",
        "|---|---|---|---|---|",
    ]
    for name, key, lkey in (
        ("forward F", "forward_s", "forward_s"),
        ("backward B", "backward_s", "backward_s"),
        ("backward, every branch dropped B0", "backward_all_dropped_s", "backward_all_dropped_s"),
        ("optimizer O", "optimizer_s", "optimizer_s"),
    ):
        lines.append(f"| {name} | {lo[lkey]:.3f} | {q[lkey]:.3f} | {diff[key]:+.3f} | {diff[key] / d:+.2f} |")
    lines.append(f"| step | {lo['step_s']:.3f} | {q['step_s']:.3f} | | |")
    lines += ["", f"D (dequantising every 4-bit weight once) = {d:.3f} s."]
    for m, verdict in r["timing"].items():
        if verdict["warning"]:
            lines.append(f"- {m}: {verdict['warning']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/qlora_cost_<preset>_cpu")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    record = measure(args.preset, args.seq_len, args.batch_size, args.rounds, args.warmup)
    args.out = args.out or RESULTS / f"qlora_cost_{args.preset}_cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "qlora_cost.json").write_text(json.dumps(record, indent=2) + "\n")
    (args.out / "qlora_cost.md").write_text(markdown(record))
    print(markdown(record))


if __name__ == "__main__":
    main()
