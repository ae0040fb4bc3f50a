"""One long document a step on a lent GPU (issue 69, item 6): step time and peak memory of full backprop and branch
drops at 0.5 and 0.875, one sequence a step, LoRA with activation checkpointing, under TRL's ``SFTTrainer``.

Shapes (random weights: a step's time and memory do not depend on them; the pretrained files are too large to carry
to the device):

- ``smollm2``: SmolLM2-135M's shape (its ``config.json``, as the bundled model has it) at 16384 tokens;
- ``llama-3.1-8b``: Llama-3.1-8B's shape (32 layers, hidden 4096, MLP 14336, 8 key-value heads, vocabulary 128256) in
  bfloat16 at 2048 and 8192 tokens;
- ``tiny``: a 4-layer Llama of width 64 (the CPU test of this script: ``tests/test_benchmark_scripts.py``).

Not here: item 6's short equal-time run of full backprop against the best drop needs SmolLM2's real weights, and the
bundled GGUF (over 64 MiB) cannot travel to the device.

One model per shape and length, LoRA (r=8, every linear layer) put on once; each arm a fresh ``SFTTrainer`` on it for
``--steps`` steps, the first ``--warmup`` untimed, arms rotated over ``--rounds`` rounds (full backprop, 0.5, 0.875,
then 0.5, 0.875, full, ...), DropBP's callback at the shipped default (cut patterns) with no warm-up, removed after its
run. Per arm: the median step over its rounds' timed steps, the speedup against full backprop's median, and the peak
of allocated device memory over its runs (``--device cpu``: none). Writes ``long_document_gpu.json`` and ``.md`` into
``--out`` after every shape (a killed call keeps what finished). The device reaches no package index: carry TRL's
wheel (``pip download --no-deps trl==1.16.0 -d wheels``, the version this checkout's tests run) and install it there::

    pip install --no-deps wheels/trl-*.whl . && python benchmarks/gpu_long_document.py --out "$OUT"  # ~6 min, H100
    python benchmarks/gpu_long_document.py --shapes tiny --device cpu --steps 2 --warmup 1 --rounds 1 --out /tmp/x
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from datetime import date
from pathlib import Path

import datasets
import torch
import transformers
import trl
from peft import LoraConfig, get_peft_model

import dropbp
from dropbp.integrations.hf import DropBPCallback
from dropbp.tools.bench import at_expected_fraction

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from sft_lora import StepTimes, checkpointing_arguments  # noqa: E402  (the example's timing and checkpointing)

#: Each shape's document lengths (tokens), as issue 69 item 6 names them.
LENGTHS = {"smollm2": (16384,), "llama-3.1-8b": (2048, 8192), "tiny": (64,)}
RATES = (None, 0.5, 0.875)  # None: full backprop


def config_of(shape: str, length: int) -> transformers.PretrainedConfig:
    if shape == "smollm2":
        config = transformers.LlamaConfig(
            hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        )  # fmt: skip
    elif shape == "llama-3.1-8b":
        config = transformers.LlamaConfig(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False,
        )  # fmt: skip
    elif shape == "tiny":
        config = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, vocab_size=96
        )
    else:
        raise ValueError(f"unknown shape {shape!r}: one of {', '.join(LENGTHS)}")
    config.max_position_embeddings = max(config.max_position_embeddings, length)
    return config


def lora_model(config: transformers.PretrainedConfig, device: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A stand-in tokenizer (the documents are token ids already; SFTTrainer wants its pad and end tokens)."""
    import tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    model = tokenizers.models.WordLevel(vocab, unk_token="<unk>")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(model), pad_token="<pad>", eos_token="<eos>"
    )


class DroppedShares(transformers.TrainerCallback):
    """The FLOP-weighted share of the branches each optimizer step dropped (one micro-batch a step)."""

    def __init__(self, drop: DropBPCallback) -> None:
        self.drop, self.shares = drop, []

    def on_step_end(self, args, state, control, **kwargs):
        ctl = self.drop.controller
        branches, dropped = ctl.branches, set(ctl.last_dropped)  # branches: views made afresh at each read
        self.shares.append(sum(b.flops for b in branches if b.name in dropped) / sum(b.flops for b in branches))


def one_arm(
    model, rate: float | None, length: int, steps: int, round_: int, args: argparse.Namespace
) -> tuple[list[float], list[float], int]:
    """One ``SFTTrainer`` run of ``steps`` steps of one random document of ``length`` tokens, drop patterns seeded by
    the round (each round draws its own); its step times, the share of branch FLOPs each step dropped, and the peak of
    allocated memory (0 off CUDA)."""
    out, device = args.out, args.device
    backend = dropbp.backends.get()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (steps, length), generator=torch.Generator().manual_seed(length)).tolist()
    times = StepTimes(backend)
    drop = None if rate is None else DropBPCallback(drop_rate=rate, warmup=0, pattern=args.pattern, seed=round_)
    shares = None if drop is None else DroppedShares(drop)
    config = trl.SFTConfig(
        output_dir=str(out / "trainer"), max_steps=steps, per_device_train_batch_size=1, learning_rate=1e-4,
        **checkpointing_arguments(), bf16=device == "cuda", use_cpu=device == "cpu", max_length=length,
        packing=False, save_strategy="no", report_to=[], seed=0, disable_tqdm=True, logging_steps=steps,
    )  # fmt: skip
    trainer = trl.SFTTrainer(
        model=model,
        args=config,
        train_dataset=datasets.Dataset.from_dict({"input_ids": ids}),
        processing_class=_tokenizer(),
        callbacks=[times] + ([] if drop is None else [drop, shares]),
    )
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    if drop is not None:
        drop.controller.remove()
    del trainer
    gc.collect()
    return times.seconds, [0.0] * steps if shares is None else shares.shares, peak


def measure(shape: str, length: int, args: argparse.Namespace) -> dict:
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if args.device == "cuda" else torch.float32
    model = lora_model(config_of(shape, length), args.device, dtype)
    seconds: dict[str, list[float]] = {}
    dropped: dict[str, list[float]] = {}
    peaks: dict[str, int] = {}
    for round_ in range(args.rounds):
        for k in range(len(RATES)):
            rate = RATES[(k + round_) % len(RATES)]
            name = "full" if rate is None else f"{rate:g}"
            steps, shares, peak = one_arm(model, rate, length, args.warmup + args.steps, round_, args)
            seconds.setdefault(name, []).extend(steps[args.warmup :])
            dropped.setdefault(name, []).extend(shares[args.warmup :])
            peaks[name] = max(peaks.get(name, 0), peak)
            print(f"{shape} {length} {name}: median {statistics.median(steps[args.warmup:]):.3f} s", flush=True)
    del model
    gc.collect()
    full = statistics.median(seconds["full"])
    rate_of = {name: 0.0 if name == "full" else float(name) for name in seconds}
    return {
        "shape": shape,
        "tokens": length,
        "pattern": args.pattern,
        "arms": {
            name: {"median_step_s": statistics.median(s), "steps": len(s), "speedup": full / statistics.median(s),
                   "step_s": s, "dropped_share": dropped[name],
                   "speedup_at_expected": full / at_expected_fraction(s, dropped[name], rate_of[name]),
                   "peak_allocated_bytes": peaks[name] or None}
            for name, s in seconds.items()
        },
    }  # fmt: skip


def table(record: dict) -> str:
    lines = [
        "| shape | tokens | pattern @ arm | median step | speedup | FLOPs dropped (mean) | speedup at expected "
        "| peak memory |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for point in record["points"]:
        for name, arm in point["arms"].items():
            peak = arm["peak_allocated_bytes"]
            memory = "-" if peak is None else f"{peak / 2**30:.2f} GiB"
            arm_name = name if name == "full" else f"{point['pattern']} @ {name}"
            lines.append(
                f"| {point['shape']} | {point['tokens']} | {arm_name} | {arm['median_step_s']:.3f} s "
                f"| {arm['speedup']:.2f}x | {statistics.mean(arm['dropped_share']):.2f} "
                f"| {arm['speedup_at_expected']:.2f}x | {memory} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(LENGTHS), default=["smollm2", "llama-3.1-8b"])
    parser.add_argument("--lengths", nargs="+", type=int, help="instead of each shape's (LENGTHS)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--pattern", default="cut", help="the drops' shape (default: the shipped default, cut)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    record = {"date": str(date.today()), "device": device_name, "torch": torch.__version__, "points": []}
    record |= {"steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "command": sys.argv}
    for shape in args.shapes:
        for length in args.lengths or LENGTHS[shape]:
            record["points"].append(measure(shape, length, args))
            (args.out / "long_document_gpu.json").write_text(json.dumps(record, indent=1) + "\n")
            (args.out / "long_document_gpu.md").write_text(table(record) + "\n")
    print(table(record))


if __name__ == "__main__":
    main()
