"""DropBP for a Hugging Face ``transformers.Trainer`` (and ``trl.SFTTrainer``, a Trainer subclass).

    from dropbp.integrations.hf import attach
    trainer = SFTTrainer(model=model, args=args, train_dataset=data)
    attach(trainer, drop_rate=0.5)      # before trainer.train()
    trainer.train()

``attach`` applies DropBP to ``trainer.model`` and adds a callback that
- warms the drop rates up from 0 over the first ``warmup`` of training (default 20%) and, knowing the
  run's length (``max_steps`` times gradient accumulation, in training forwards), gives the drop rate
  its time schedule (``drop_schedule``, :mod:`dropbp.schedule`) with the run's mean rate equal to
  ``drop_rate``: what the warm-up leaves undropped is dropped later,
- with the paper's uniform patterns (``pattern="uniform"``), calibrates once, at ``calibrate_at`` of
  training (default 10%), on the first batch of the training data with the trainer's own
  ``compute_loss`` (one forward; see ``DropBPController.calibrate``); the default cut patterns keep
  their own rates,
- logs the calibrated rates and, at every logging step, the drop figures since the last log
  (``dropbp/dropped_branches`` per forward, ``dropbp/dropped_flops_fraction``) through
  ``trainer.log``, so they reach the console, ``log_history`` and every report integration,
- saves the controller state (rates, seed, step counter, whether calibrated) as
  ``dropbp_state.json`` in each checkpoint folder and restores it when training resumes (from
  ``output_dir/checkpoint-<step>`` or ``args.resume_from_checkpoint``), so a resumed run continues
  with exactly the patterns of an uninterrupted one.

Gradient accumulation: a new pattern is drawn for every micro-batch (each training forward), not
once per optimizer step, so the accumulated gradient averages over several sub-networks.
No step can fail because every trainable branch dropped (``DropBPController`` guarantees it).
The trainer places its own step boundaries; nothing here adds graph breaks.

Multi-process (``torchrun`` / ``accelerate launch``): every rank draws the same patterns. DDP must
accept parameters left without a gradient, so when ``ddp_find_unused_parameters`` is left unset
(the Trainer would turn it off under activation checkpointing) ``attach`` sets it to True.
DeepSpeed ZeRO stages 1 to 3 (``deepspeed=`` in the arguments, or ``accelerate launch`` with a
DeepSpeed config) work as they are; a configuration DropBP cannot train with is refused here, before
anything is attached (:mod:`dropbp.integrations.deepspeed`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .. import apply
from ..checks import check_choice, check_fraction
from ..controller import DropBPController
from ..dropped_grads import DEFAULT_DROPPED_GRADS
from ..policy import DEFAULT_RAMP
from ..sampler import SAMPLERS

__all__ = ["STATE_FILE", "DropBPCallback", "attach", "build_callback", "check_schedule"]

log = logging.getLogger("dropbp")

STATE_FILE = "dropbp_state.json"


class DropBPCallback(TrainerCallback):
    """Calibration, logging and checkpointing of a :class:`DropBPController` inside a Trainer."""

    def __init__(
        self, trainer: Trainer, controller: DropBPController, calibrate_at: float | None, warmup: float = 0.0
    ) -> None:
        self.trainer = trainer
        self.controller = controller
        self.calibrate_at = calibrate_at
        self.warmup = warmup
        self.calibrated = False

    def _calibration_step(self, state: TrainerState) -> int | None:
        if self.calibrate_at is None or self.calibrated:
            return None
        return int(self.calibrate_at * state.max_steps)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any):
        forwards = state.max_steps * args.gradient_accumulation_steps  # the controller counts micro-batches
        if self.warmup:
            self.controller.warmup_steps = round(self.warmup * forwards)
        self.controller.total_steps = forwards
        if state.global_step == 0:
            return
        folders = [os.path.join(args.output_dir, f"checkpoint-{state.global_step}")]
        if isinstance(args.resume_from_checkpoint, str):
            folders.insert(0, args.resume_from_checkpoint)
        path = next((p for p in (os.path.join(d, STATE_FILE) for d in folders) if os.path.isfile(p)), None)
        if path is None:
            log.warning(
                "dropbp: resuming at step %d but no %s in %s; drop patterns restart from this "
                "controller's state and will differ from an uninterrupted run",
                state.global_step,
                STATE_FILE,
                " or ".join(folders),
            )
            return
        with open(path) as f:
            saved = json.load(f)
        self.controller.load_state_dict(saved["controller"])
        self.calibrated = saved["calibrated"]

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any):
        if state.global_step != self._calibration_step(state):
            return
        batch = next(iter(self.trainer.get_train_dataloader()))
        inputs = self.trainer._prepare_inputs(batch)
        model = self.trainer.model
        self.controller.calibrate(lambda: self.trainer.compute_loss(model, inputs))
        self.calibrated = True
        rates = self.controller.rates
        log.info("dropbp: calibrated at step %d; rates %s", state.global_step, [round(r, 2) for r in rates])
        self.trainer.log(
            {
                "dropbp/rate_mean": sum(rates) / len(rates),
                "dropbp/rate_min": min(rates),
                "dropbp/rate_max": max(rates),
                **{f"dropbp/rate/{i}": r for i, r in enumerate(rates)},
            }
        )

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any):
        if control.should_log:
            stats = self.controller.drop_stats(reset=True)
            self.trainer.log(
                {
                    "dropbp/dropped_branches": stats["dropped_branches"],
                    "dropbp/dropped_flops_fraction": stats["dropped_flops_fraction"],
                }
            )
            control.should_log = True  # Trainer.log cleared it: the Trainer still logs its loss at this step

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any):
        if not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, STATE_FILE), "w") as f:
            json.dump({"controller": self.controller.state_dict(), "calibrated": self.calibrated}, f)


def attach(
    trainer: Trainer,
    drop_rate: float = 0.5,
    *,
    calibrate_at: float | None | str = "auto",
    seed: int | None = None,
    branches: Sequence[str] | None = None,
    max_patterns: int | None = None,
    unbiased: bool = False,
    dropped_grads: str = DEFAULT_DROPPED_GRADS,
    warmup: float = 0.2,
    pattern: str = "cut",
    chunked_loss: bool | int = False,
    drop_schedule: str = "constant",
    ramp: float = DEFAULT_RAMP,
) -> DropBPCallback:
    """Attach DropBP to ``trainer.model`` and register its callback; call before ``trainer.train()``.

    ``pattern`` is :func:`dropbp.apply`'s (``"cut"``, or ``"uniform"`` for the paper's patterns).
    ``calibrate_at``: fraction of the training steps at which sensitivities are measured and the
    rates allocated, uniform patterns only; ``"auto"``: 0.1 with ``pattern="uniform"`` (the paper),
    ``None`` (keep the shape's own rates) with ``"cut"``. ``seed`` defaults to ``trainer.args.seed``.
    ``unbiased`` and ``dropped_grads`` are :func:`dropbp.apply`'s; the dropped gradients are filled
    in an optimizer pre-step hook, after the Trainer's gradient clipping. ``warmup``: fraction of the
    training steps over which the rates rise from 0 (``dropbp.apply``'s ``warmup_steps``); 0.2, the
    best setting measured (docs/convergence.md), 0 to drop from the first step. Pass
    ``pattern="uniform"`` for the memory saving too (every step then drops about ``drop_rate`` of the
    branches; a cut drops none in some steps). ``chunked_loss``: :func:`dropbp.apply`'s,
    the memory-lean head and loss for long sequences (:mod:`dropbp.chunked_loss`). ``drop_schedule``
    and ``ramp``: :func:`dropbp.apply`'s, over the run's length, which ``attach`` passes as
    ``total_steps`` when training begins: the run's mean drop rate, warm-up included, is ``drop_rate``.
    Returns the callback; its ``controller`` is the :class:`DropBPController`. ``callback.controller.remove()``
    takes DropBP off the model and the callback off the trainer; only then can ``attach`` be called again.
    """
    callback = build_callback(
        trainer,
        drop_rate,
        calibrate_at=calibrate_at,
        seed=seed,
        branches=branches,
        max_patterns=max_patterns,
        unbiased=unbiased,
        dropped_grads=dropped_grads,
        warmup=warmup,
        pattern=pattern,
        chunked_loss=chunked_loss,
        drop_schedule=drop_schedule,
        ramp=ramp,
    )
    trainer.add_callback(callback)
    return callback


def build_callback(
    trainer: Trainer,
    drop_rate: float = 0.5,
    *,
    calibrate_at: float | None | str = "auto",
    seed: int | None = None,
    branches: Sequence[str] | None = None,
    max_patterns: int | None = None,
    unbiased: bool = False,
    dropped_grads: str = DEFAULT_DROPPED_GRADS,
    warmup: float = 0.2,
    pattern: str = "cut",
    chunked_loss: bool | int = False,
    drop_schedule: str = "constant",
    ramp: float = DEFAULT_RAMP,
) -> DropBPCallback:
    """:func:`attach` without registering the callback: for frameworks that add callbacks themselves.

    Applies DropBP to ``trainer.model`` (arguments as :func:`attach`) and returns the callback that
    the caller must add to ``trainer`` exactly once (axolotl's plugin hands it back from
    ``add_callbacks_post_trainer``, and axolotl adds it).
    """
    if not isinstance(trainer, Trainer):
        raise TypeError(f"trainer must be a transformers.Trainer, got {type(trainer).__name__}")
    pattern, calibrate_at, warmup = check_schedule(pattern, calibrate_at, warmup)
    if getattr(trainer, "is_deepspeed_enabled", False):  # --deepspeed, or accelerate launch with DeepSpeed
        from .deepspeed import check_config

        config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
        check_config(config, dropped_grads, trainer.args.gradient_accumulation_steps)
    controller = apply(
        trainer.model,
        drop_rate,
        seed=trainer.args.seed if seed is None else seed,
        branches=branches,
        max_patterns=max_patterns,
        unbiased=unbiased,
        dropped_grads=dropped_grads,
        pattern=pattern,
        chunked_loss=chunked_loss,
        drop_schedule=drop_schedule,
        ramp=ramp,
    )
    _let_ddp_skip_unused_parameters(trainer)
    callback = DropBPCallback(trainer, controller, calibrate_at, warmup)
    # ``callback.controller.remove()`` takes the callback off the trainer too: a removed controller's callback
    # would stop train() ("this DropBP controller was removed"), and attach again would leave two.
    controller.on_remove(lambda: trainer.pop_callback(callback))
    return callback


def check_schedule(
    pattern: object, calibrate_at: object, warmup: object, *, prefix: str = ""
) -> tuple[str, float | None, float]:
    """:func:`attach`'s ``pattern``, ``calibrate_at`` and ``warmup`` checked, ``calibrate_at="auto"`` resolved.

    Separate from :func:`attach` so a config file can be checked before any model is loaded (the
    axolotl plugin's arguments). ``prefix`` goes before every argument name in the messages, so they
    name the keys the user wrote (``dropbp_pattern``).
    """
    pattern = check_choice(f"{prefix}pattern", pattern, tuple(SAMPLERS))
    if calibrate_at == "auto":
        calibrate_at = 0.1 if pattern == "uniform" else None
    if calibrate_at is not None:
        calibrate_at = check_fraction(
            f"{prefix}calibrate_at", calibrate_at, what="a fraction of the training steps (or None)"
        )
        if pattern != "uniform":
            raise ValueError(
                f"{prefix}calibrate_at={calibrate_at} needs {prefix}pattern='uniform': calibrated rates do not fall "
                f"with depth, so {prefix}pattern={pattern!r} cannot realise them; pass {prefix}pattern='uniform' to "
                f"calibrate, or {prefix}calibrate_at=None"
            )
    warmup = check_fraction(f"{prefix}warmup", warmup, what="a fraction of the training steps")
    return pattern, calibrate_at, warmup


def _let_ddp_skip_unused_parameters(trainer: Trainer) -> None:
    """``find_unused_parameters=True`` for the DDP wrapper the trainer will build, unless the user chose.

    The Trainer builds its Accelerator's DDP settings in ``__init__``, so the Accelerator's handler is
    updated along with the argument. An explicit False is left alone: DropBP then stops at the first
    training forward with a message saying what to set (:mod:`dropbp.distributed`).
    """
    if trainer.args.ddp_find_unused_parameters is not None:
        return
    trainer.args.ddp_find_unused_parameters = True
    handler = getattr(getattr(trainer, "accelerator", None), "ddp_handler", None)
    if handler is not None:
        handler.find_unused_parameters = True
