"""DropBP for a Hugging Face ``transformers.Trainer`` and the trainers built on it (TRL, LLaMA-Factory).

``Trainer(..., callbacks=[DropBPCallback(drop_rate=0.5)])`` applies DropBP when training begins; ``attach(trainer,
drop_rate=0.5)`` applies it at once to a trainer already made. Options: :class:`dropbp.options.TrainerOptions`.
Over the run the callback sets the warm-up and time schedule from the run's length, calibrates uniform patterns
once, logs ``dropbp/*`` figures (to every callback's ``on_log`` as ``Trainer.log`` does where the trainer is known:
``attach``; else to ``log_history`` and the ``dropbp`` logger), and saves and restores the controller's state beside
each checkpoint. It places no graph break (the trainer does). What each step does, DDP and DeepSpeed notes:
docs/trainer.md.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler

from dropbp.controller import DropBPController, controller_of
from dropbp.execution.frameworks import unwrap
from dropbp.experimental.where_it_pays import forecast
from dropbp.features.base import dropped_fill, feature_classes
from dropbp.features.noise_scale import noise_scale_forecast
from dropbp.files import read_json, write_atomically
from dropbp.internals import prepared_inputs
from dropbp.options import AUTO_WARMUP, TrainerOptions, moved, takes_options

__all__ = [
    "STATE_FILE",
    "DropBPCallback",
    "attach",
    "build_callback",
    "callback_for",
    "fit_auto_warmup",
    "log_forecast",
]

log = logging.getLogger("dropbp")

STATE_FILE = "dropbp_state.json"
#: The settings a callback's own options decide, which a resumed checkpoint's state must not silently replace.
CALLBACK_DECIDES = ("drop_rate", "pattern", "max_patterns")
#: Optimizer steps measured before the noise scale's forecast is logged (once).
NOISE_FORECAST_STEPS = 4
#: With the noise scale measured, windows of 2 micro-batches read before the first step for the start's forecast.
START_WINDOWS = 4


def log_forecast(args: TrainingArguments, state: TrainerState, drop_rate: float) -> None:
    """Log what the measured map forecasts for this run (:mod:`dropbp.experimental.where_it_pays`): a warning where
    DropBP is not expected to reach full backprop's quality sooner, else at info level. Tokens per step come from the
    arguments' sequence length where they name one (TRL's ``max_length``: at most that many)."""
    if state.max_steps < 1 or drop_rate == 0:
        return
    length = getattr(args, "max_length", None) or getattr(args, "max_seq_length", None)
    sequences = args.per_device_train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size)
    tokens = sequences * length if isinstance(length, int) and length > 0 else None
    seen = forecast(state.max_steps, tokens, drop_rate)
    log.log(logging.INFO if seen.pays else logging.WARNING, "%s", seen.message)


def start_batches(loader: object, count: int) -> list[Any]:
    """``count`` micro-batches of the run's data for the start's noise-scale reading, without iterating the
    dataloader (whose iterator, sampler and RNG the run's own order depends on): dataset rows spread evenly over the
    dataset, in micro-batches of the loader's size, through its collator, the RNG states restored after. Empty
    where the loader has no indexable dataset (an iterable one) or too few rows."""
    import random

    import torch

    dataset, collate = getattr(loader, "dataset", None), getattr(loader, "collate_fn", None)
    size = getattr(loader, "batch_size", None) or getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    try:
        rows = len(dataset)  # type: ignore[arg-type]
        dataset[0]  # type: ignore[index]
    except (TypeError, NotImplementedError, KeyError, IndexError):
        return []
    if collate is None or not isinstance(size, int) or rows < count * size:
        return []
    states = random.getstate(), torch.get_rng_state()
    try:
        spread = [round(i * (rows - 1) / (count * size - 1)) for i in range(count * size)]
        return [collate([dataset[j] for j in spread[k * size : (k + 1) * size]]) for k in range(count)]
    finally:
        random.setstate(states[0])
        torch.set_rng_state(states[1])


def training_forwards(optimizer_steps: int, accumulation: int, dataloader: object | None) -> int:
    """The training forwards (micro-batches) a run of ``optimizer_steps`` makes. Transformers ends each epoch with
    a short window where the dataloader's length is not a multiple of ``accumulation`` (``ceil(n / accumulation)``
    steps of ``n`` batches), so the count is per epoch, not ``optimizer_steps * accumulation``; a dataloader
    without a length (an iterable dataset) has no epochs to end."""
    try:
        batches = len(dataloader)  # type: ignore[arg-type]
    except TypeError:
        batches = 0
    if batches <= 0 or batches % accumulation == 0:
        return optimizer_steps * accumulation
    per_epoch = -(-batches // accumulation)
    epochs, rest = divmod(optimizer_steps, per_epoch)
    return epochs * batches + rest * accumulation


def epoch_windows(accumulation: int, dataloader: object | None) -> tuple[int, int] | None:
    """The run's optimizer-step windows (:mod:`dropbp.policy.windows`) where its epochs end with a short window:
    ``(batches per epoch, accumulation)``; ``None`` where every window is whole or the dataloader has no length."""
    try:
        batches = len(dataloader)  # type: ignore[arg-type]
    except TypeError:
        return None
    return (batches, accumulation) if batches > 0 and batches % accumulation else None


def check_gaudi_arguments(args: Any) -> None:
    """Refuse the optimum-habana ``GaudiTrainingArguments`` dropbp cannot follow (the others work unchanged:
    docs/backends.md's table). ``use_hpu_graphs_for_training`` caches the forward as HPU graphs replayed by input
    shape alone, which Habana documents as unfit for data-dependent Python flow such as a per-step drop pattern."""
    if getattr(args, "use_hpu_graphs_for_training", False):
        raise ValueError(
            "DropBPCallback: use_hpu_graphs_for_training=True cannot be used with dropbp. optimum-habana then caches "
            "the model's forward as HPU graphs (Habana's ModuleCacher), which are replayed by input shape "
            "alone: the branches dropbp chooses each step would not change after the capture. Set "
            "use_hpu_graphs_for_training=False; in lazy mode dropbp bounds the graphs compiled itself (max_patterns; "
            "ctl.schedule.patterns() says how many)."
        )


class DropBPCallback(TrainerCallback):
    """DropBP in a Trainer, from its options alone: ``Trainer(..., callbacks=[DropBPCallback(drop_rate=0.5)])``.

    Applies :func:`dropbp.apply` to the trainer's model when training begins, then warms up, schedules,
    calibrates, logs and checkpoints as the module's docstring says. ``callback.controller`` is the
    :class:`DropBPController` (``None`` until training begins); ``callback.controller.remove()`` takes
    DropBP off the model and leaves this callback idle (off its trainer, where :func:`attach` made it).
    """

    @takes_options(TrainerOptions)
    def __init__(self, drop_rate: float = 0.5, **options: Any) -> None:
        self._setup(TrainerOptions.given("DropBPCallback", drop_rate=drop_rate, **options))

    def _setup(self, options: TrainerOptions) -> None:
        #: The options, checked when made.
        self.options = options
        #: The controller; ``None`` until DropBP is applied (by :func:`attach`, or when training begins).
        self.controller: DropBPController | None = None
        self._noise_forecast_said = False
        self._moving = False  # a new train()'s model takes the controller: its removal keeps the callback
        self._forwards = 0  # the training forwards of the run under way (training_forwards)
        self._windows: tuple[int, int] | None = None  # its optimizer-step windows (epoch_windows)
        #: The trainer, known when :func:`attach` (or :func:`build_callback`) made this callback; else ``None``.
        self.trainer: Trainer | None = None
        self.calibrated = False
        self._handler: CallbackHandler | None = None  # the trainer's, to log as Trainer.log does and to leave it
        self._removed = False

    @classmethod
    def experimental(cls, drop_rate: float | str = 0.5, **options: Any) -> DropBPCallback:
        """0.3's callback with the experimental options: refused, naming the 0.4 way (each is a feature now:
        ``DropBPCallback(drop_rate, features=[...])``)."""
        ways = [f"{name} {moved(name)}" for name in options if moved(name) is not None]
        raise TypeError(
            "DropBPCallback.experimental is gone in dropbp 0.4: pass DropBPCallback(drop_rate, ..., features=[...]) "
            "the experimental features of dropbp.experimental" + ("; " + "; ".join(ways) if ways else "")
        )

    @classmethod
    def from_options(cls, options: TrainerOptions) -> DropBPCallback:
        """The callback of already checked options (:func:`attach`, the axolotl plugin)."""
        if not isinstance(options, TrainerOptions):
            raise TypeError(f"options must be a dropbp.options.TrainerOptions, got {type(options).__name__}")
        callback = cls.__new__(cls)
        callback._setup(options)
        return callback

    @property
    def calibrate_at(self) -> float | None:
        """The fraction of the training steps at which the rates are calibrated (``"auto"`` resolved), or None."""
        return self.options.calibration_point

    @property
    def warmup(self) -> float:
        """The fraction of the training steps over which the rates rise from 0 (``"auto"``: 0.2, which
        a high drop rate may shorten when training begins; ``controller.warmup_steps`` is then the run's)."""
        fraction = self.options.warmup_fraction
        return AUTO_WARMUP if fraction is None else fraction

    def _bind(self, trainer: Trainer) -> None:
        """Apply DropBP to ``trainer.model`` now, knowing the trainer (what :func:`attach` does)."""
        if not isinstance(trainer, Trainer):
            raise TypeError(f"trainer must be a transformers.Trainer, got {type(trainer).__name__}")
        check_gaudi_arguments(trainer.args)
        if getattr(trainer, "is_deepspeed_enabled", False):  # --deepspeed, or accelerate launch with DeepSpeed
            self._check_deepspeed(trainer.accelerator.state.deepspeed_plugin, trainer.args)
        self.trainer = trainer
        self._handler = trainer.callback_handler
        self._apply(trainer.model, trainer.args)
        _let_ddp_skip_unused_parameters(trainer)

    def _check_deepspeed(self, plugin: Any, args: TrainingArguments) -> None:
        from dropbp.integrations.deepspeed import check_config

        check_config(plugin.deepspeed_config, dropped_fill(self.options.features), args.gradient_accumulation_steps)

    def _apply(self, model: Any, args: TrainingArguments) -> None:
        seed = args.seed if self.options.seed is None else self.options.seed
        self.controller = DropBPController(model, **self.options.apply_keywords(seed=seed))
        # Removing the controller takes the callback off the trainer too: a removed controller's callback
        # would stop train() ("this DropBP controller was removed"), and attach again would leave two.
        self.controller.at_remove(self._leave)

    def _leave(self) -> None:
        if self._moving:
            return  # the controller moves to the model a new train() trains (model_init): the callback stays
        self._removed = True
        if self._handler is not None and self in self._handler.callbacks:
            self._handler.remove_callback(self)

    def _move_to(self, model: Any, args: TrainingArguments) -> None:
        """``Trainer(model_init=...)``: each ``train()`` (every trial of ``hyperparameter_search``) trains a new
        model; DropBP leaves the previous one and applies to it with the same options, from step 0."""
        previous, self._moving = self.controller, True
        try:
            previous.remove()
        finally:
            self._moving = False
        self._apply(model, args)
        self.calibrated = False
        log.info("dropbp: this train() trains a new model (model_init): DropBP applied to it with the same options")

    def _restart(self) -> None:
        """A second ``train()`` of the same model from step 0: a new run, whose schedule (warm-up, time schedule,
        calibration) starts again rather than continuing past the previous run's end."""
        ctl = self.controller
        log.info(
            "dropbp: a new training run on this model (train() again, from step 0): the drop schedule restarts "
            "(it had counted %d training forwards)",
            ctl.step,
        )
        ctl.load_state_dict(ctl.state_dict() | {"step": 0})
        self.calibrated = False

    def _active(self) -> bool:
        return self.controller is not None and not self._removed

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any):
        if self._handler is None and args.report_to and not self._removed:
            log.warning(
                "dropbp: DropBPCallback was given to the Trainer, which hands its callbacks neither itself nor the "
                "loggers of report_to=%s: dropbp's statistics (dropbp/...) go to trainer.state.log_history and "
                "the 'dropbp' logger only. To see them in %s, apply it with dropbp.attach(trainer, ...) instead.",
                args.report_to,
                ", ".join(args.report_to),
            )
        if self._removed:
            return
        check_gaudi_arguments(args)
        if self.controller is None:
            if kw.get("model") is None:
                raise RuntimeError("DropBPCallback: the Trainer handed its callbacks no model at on_train_begin")
            plugin = getattr(args, "deepspeed_plugin", None)
            if plugin is not None:
                self._check_deepspeed(plugin, args)
            self._apply(kw["model"], args)
        elif kw.get("model") is not None and controller_of(unwrap(kw["model"])[0]) is not self.controller:
            self._move_to(kw["model"], args)
        elif state.global_step == 0 and self.controller.step > 0:
            self._restart()
        noise = self.controller.features.get("noise_scale")
        if noise is not None and args.gradient_accumulation_steps < 2:
            why = noise.one_micro_batch()
            if why is None:
                log.info(
                    "dropbp: gradient_accumulation_steps=1: the gradient noise scale is read from within each step, "
                    "the output layer's gradient over 8 chunks of the step's tokens (the last hidden layer's noise: "
                    "docs/noise-scale.md)"
                )
            else:
                log.warning(
                    "dropbp: gradient_accumulation_steps=1 gives one micro-batch per optimizer step, and %s: the "
                    "gradient noise scale cannot be read from within the step either, so nothing will be measured%s. "
                    "Set gradient_accumulation_steps >= 2 (e.g. halve per_device_train_batch_size and double it) or "
                    "measure it apart: dropbp check --model PATH --data FILE.",
                    why,
                    ', and drop_rate="auto" stays at full backprop for the whole run'
                    if self.controller.options.follows_noise_scale
                    else "",
                )
        loader = kw.get("train_dataloader")
        self._forwards = training_forwards(state.max_steps, args.gradient_accumulation_steps, loader)
        self._windows = epoch_windows(args.gradient_accumulation_steps, loader)
        self._follow_windows()
        self._schedule(self._forwards)  # the controller counts micro-batches
        if state.global_step == 0:
            if not self._forecast_at_start(args, state, kw.get("model"), loader):
                log_forecast(args, state, self.controller.drop_rate)
            return
        folders = [_checkpoint_folder(args, state.global_step)]
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
        saved = read_json(
            path, "delete it to restart the drop patterns from this controller's state, or resume from an earlier one"
        )
        if (
            not isinstance(saved, dict)
            or set(saved) != {"controller", "calibrated"}
            or not isinstance(saved["calibrated"], bool)
        ):
            raise ValueError(
                f"dropbp: {path} is not a state dropbp wrote (expected the keys 'controller' and 'calibrated', a "
                "bool); delete it to restart the drop patterns from this controller's state"
            )
        state = saved["controller"]
        changed, features = self._asked_otherwise(state), self._features_otherwise(state)
        # with the callback's settings, so that a state another device saved (max_patterns=None on the CPU, 16 on a
        # lazy device; stratified cuts, which a lazy device cannot draw) loads where the callback asks for what this
        # one takes; the drop rate follows in _honour
        overlay = {name: value for name, value in changed.items() if name != "drop_rate"}
        if isinstance(state, dict):
            kept = {k: v for k, v in state.items() if k not in features}
            state = kept | overlay | {key: asked for key, (_, asked) in features.items() if asked is not None}
        try:
            self.controller.load_state_dict(state)
        except (TypeError, ValueError) as error:
            raise type(error)(f"dropbp: the state in {path} was refused: {error}") from None
        self.calibrated = saved["calibrated"]
        self._honour({name: saved["controller"][name] for name in changed}, changed, path, features)
        self._follow_windows()  # a state saved by another run, or before windows were kept, has others
        forwards = self._forwards
        if not self.options.follows_noise_scale and self.controller.total_steps != forwards:
            self._replan(forwards)

    def _forecast_at_start(self, args: TrainingArguments, state: TrainerState, model: Any, loader: Any) -> bool:
        """With the noise scale measured: read it before the first step on :data:`START_WINDOWS` windows of two
        micro-batches of the run's own data (:func:`start_batches`; DropBP held off, the weights and gradients left as
        they were) and log its forecast per arm at the run's tokens per step. False where it cannot be read (no
        indexable data, no loss): the caller logs the map's forecast instead."""
        from dataclasses import replace

        from dropbp.features.gradient_noise import measure_windows

        ctl = self.controller
        if "noise_scale" not in ctl.features or model is None:
            return False
        batches = start_batches(loader, 2 * START_WINDOWS)
        if not batches:
            return False
        device = next(model.parameters()).device
        moved = [{k: v.to(device) if hasattr(v, "to") else v for k, v in b.items()} for b in batches]
        with ctl.forcing(()):
            measured = measure_windows(model, [moved[i : i + 2] for i in range(0, len(moved), 2)])
        if measured is None:
            return False
        per_step = measured.tokens_per_step / 2 * args.gradient_accumulation_steps * max(1, args.world_size)
        if state.is_world_process_zero:
            log.info(
                "dropbp: before the first step, on %d micro-batches of this run's data: %s",
                len(batches),
                noise_scale_forecast(replace(measured, tokens_per_step=per_step), ctl.drop_rate),
            )
        return True

    def _asked_otherwise(self, state: object) -> dict[str, Any]:
        """The settings this callback decides (:data:`CALLBACK_DECIDES`) whose asked value differs from ``state``'s;
        ``max_patterns=None`` asks for this device's own bound, which a state saved on the same device holds."""
        if not isinstance(state, dict):
            return {}  # load_state_dict refuses it, naming what is wrong
        given = self.controller.options
        asked = {name: getattr(given, name) for name in CALLBACK_DECIDES if name in state}
        if asked.get("max_patterns", 0) is None:
            asked["max_patterns"] = self.controller.backend.default_max_patterns
        return {name: getattr(given, name) for name, value in asked.items() if state[name] != value}

    def _features_otherwise(self, state: object) -> dict[str, tuple[Any, Any]]:
        """The features that decide the patterns (``Feature.needed_to_resume``) whose settings this callback asks
        otherwise than ``state`` saved them: per key, (saved, asked), None where not attached."""
        if not isinstance(state, dict):
            return {}
        ours, found = self.controller.features, {}
        for key, cls in feature_classes().items():
            saved, asked = state.get(key), (ours[key].config() if key in ours else None)
            if cls.needed_to_resume and saved != asked:
                found[key] = (saved, asked)
        return found

    def _honour(
        self, saved: dict[str, Any], changed: dict[str, Any], path: str, features: dict[str, tuple[Any, Any]]
    ) -> None:
        """A resumed run whose callback asks for other settings (``changed``, and the pattern-deciding ``features``)
        than the checkpoint's (``saved``): the callback's are used from here on (the step counter, and the rates where
        the shape's own, resume from the checkpoint), said once."""
        ctl = self.controller
        if features:
            saved = saved | {key: was for key, (was, _) in features.items()}
        if not changed and not features:
            return
        if self.options.follows_noise_scale:
            ctl.replace_options(**changed)
        elif changed:  # the checkpoint's warm-up was fitted to its own rate: fit the schedule again to the asked one
            ctl.replace_options(**changed, warmup_steps=0, total_steps=None)
            self._schedule(self._forwards)
        asked = changed | {key: now for key, (_, now) in features.items()}
        log.warning(
            "dropbp: resumed from %s, saved with %s; this callback asks for %s: the callback's settings are used "
            "from here on, so the patterns differ from an uninterrupted run of either.",
            path,
            ", ".join(f"{name}={saved[name]!r}" for name in asked),
            ", ".join(f"{name}={value!r}" for name, value in asked.items()),
        )

    def _replan(self, forwards: int) -> None:
        """A run resumed with another length (``max_steps`` changed): the schedule follows the new length from
        here on; the forwards already run followed the old one, so the run's mean drop rate moves. Said plainly."""
        ctl = self.controller
        done, before = ctl.step, ctl.total_steps
        spent = ctl.schedule.mean_drop_rate(0, done) * done if done else 0.0
        self._schedule(forwards)
        rest = ctl.schedule.mean_drop_rate(done, forwards) * (forwards - done) if forwards > done else 0.0
        mean = (spent + rest) / max(forwards, done)
        log.warning(
            "dropbp: this run resumed at training forward %d with another length: %s forwards before, %d now "
            "(max_steps x gradient_accumulation_steps). The drop schedule now follows the new length (warm-up "
            "included); the forwards already run followed the old one, so the whole run's mean drop rate is %.3f "
            "instead of drop_rate=%g.",
            done,
            before,
            forwards,
            mean,
            ctl.drop_rate,
        )

    def _follow_windows(self) -> None:
        """The run's optimizer-step windows on the controller (the run decides them, as the schedule's length)."""
        if self.controller.windows != self._windows:
            self.controller.windows = self._windows

    def _schedule(self, forwards: int) -> None:
        """The warm-up and the time schedule over a run of ``forwards`` training forwards.

        Keeping the run's mean drop rate, a warm-up is paid for by higher rates after it, which a high drop
        rate cannot always take (no cut drops the top branch). A warm-up the user chose is then refused
        (the controller's message says what to change); ``"auto"`` takes the longest that fits, up to 20%.
        """
        ctl = self.controller
        if self.options.follows_noise_scale:
            return  # the measured noise scale sets each step's rate: no warm-up or time schedule
        if self.options.warmup_fraction is not None:
            ctl.replace_options(warmup_steps=round(self.warmup * forwards), total_steps=forwards)
            return
        longest = round(AUTO_WARMUP * forwards)
        fits = fit_auto_warmup(ctl, forwards)
        if fits == longest:
            return
        log.warning(
            "dropbp: warm-up shortened from %d to %d of the run's %d training forwards (warmup='auto'): to keep "
            "the run's mean drop rate at %g, a longer one would need rates after it that the %r pattern shape "
            "cannot take. Pass warmup= to choose (0: none).",
            longest,
            fits,
            forwards,
            ctl.drop_rate,
            ctl.pattern,
        )

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any):
        if not self._active() or self.calibrate_at is None or self.calibrated:
            return
        if state.global_step != int(self.calibrate_at * state.max_steps):
            return
        batch = _first_batch(kw["train_dataloader"])
        if self.trainer is not None:
            trainer, inputs = self.trainer, prepared_inputs(self.trainer, batch)
            self.controller.calibrate(lambda: trainer.compute_loss(trainer.model, inputs))
        else:
            model = kw["model"]
            inputs = _to_device(batch, next(model.parameters()).device)
            self.controller.calibrate(lambda: _own_loss(model, inputs))
        self.calibrated = True
        rates = self.controller.rates
        log.info("dropbp: calibrated at step %d; rates %s", state.global_step, [round(r, 2) for r in rates])
        self._log(
            args,
            state,
            control,
            {
                "dropbp/rate_mean": sum(rates) / len(rates),
                "dropbp/rate_min": min(rates),
                "dropbp/rate_max": max(rates),
                **{f"dropbp/rate/{i}": r for i, r in enumerate(rates)},
            },
        )

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any):
        noise = self.controller.features.get("noise_scale") if self._active() else None
        if noise is not None:  # the step's micro-batches are all read: it closes now, before a checkpoint saves it
            noise.flush()
        if self._active() and control.should_log:
            stats = self.controller.schedule.drop_stats(reset=True)
            logs = {
                "dropbp/dropped_branches": stats["dropped_branches"],
                "dropbp/dropped_flops_fraction": stats["dropped_flops_fraction"],
            }
            for feature in self.controller.features.values():  # each feature's own figures
                logs |= {f"dropbp/{name}": value for name, value in feature.logs().items()}
            noise = self.controller.features.get("noise_scale")
            measured = None if noise is None else noise.estimate()
            if measured is not None and not self._noise_forecast_said and measured.steps >= NOISE_FORECAST_STEPS:
                self._noise_forecast_said = True
                log.info("%s", noise_scale_forecast(measured, self.controller.drop_rate))
            self._log(args, state, control, logs)
            control.should_log = True  # the log cleared it: the Trainer still logs its loss at this step

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any):
        if not self._active() or not state.is_world_process_zero:
            return
        folder = _checkpoint_folder(args, state.global_step)
        os.makedirs(folder, exist_ok=True)
        state_json = json.dumps({"controller": self.controller.state_dict(), "calibrated": self.calibrated})
        write_atomically(os.path.join(folder, STATE_FILE), state_json)

    def _log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict) -> None:
        """What ``Trainer.log`` does, without the trainer: an entry in ``log_history``, then every ``on_log``.

        Not ``trainer.log`` itself, even when the trainer is known, so ``attach`` and ``DropBPCallback`` log
        alike: a subclass's ``log`` (TRL's) would merge its own pending metrics into DropBP's entry.
        """
        if state.epoch is not None:
            logs["epoch"] = state.epoch
        if getattr(args, "include_num_input_tokens_seen", "no") not in ("no", False):
            logs["num_input_tokens_seen"] = state.num_input_tokens_seen
        state.log_history.append({**logs, "step": state.global_step})
        if self._handler is not None:
            self._handler.on_log(args, state, control, logs)
        else:
            log.info("dropbp: step %d: %s", state.global_step, logs)


def fit_auto_warmup(ctl: DropBPController, forwards: int) -> int:
    """Set ``ctl``'s schedule as ``warmup="auto"`` does for a run of ``forwards`` training forwards: the time
    schedule over them and the longest warm-up, up to 20% of them, whose peak the pattern shape can take (the
    peak grows with the warm-up). Returns that warm-up."""
    longest = ctl.schedule.longest_warmup(forwards, round(AUTO_WARMUP * forwards))
    ctl.replace_options(warmup_steps=longest, total_steps=forwards)
    return longest


@takes_options(TrainerOptions)
def attach(trainer: Trainer, drop_rate: float = 0.5, **options: Any) -> DropBPCallback:
    """Attach DropBP to ``trainer.model`` and register its callback; call before ``trainer.train()``.

    The one-liner for a trainer already made: :class:`DropBPCallback` with the same options, applied at
    once (``seed`` defaults to ``trainer.args.seed``). Returns the callback; its ``controller`` is the
    :class:`DropBPController`. ``callback.controller.remove()`` takes DropBP off the model and the
    callback off the trainer; only then can ``attach`` be called again.
    """
    callback = callback_for(trainer, TrainerOptions.given("attach", drop_rate=drop_rate, **options))
    trainer.add_callback(callback)
    return callback


@takes_options(TrainerOptions)
def build_callback(trainer: Trainer, drop_rate: float = 0.5, **options: Any) -> DropBPCallback:
    """:func:`attach` without registering the callback: for frameworks that add callbacks themselves.

    Applies DropBP to ``trainer.model`` (options as :func:`attach`) and returns the callback that
    the caller must add to ``trainer`` exactly once (axolotl's plugin hands it back from
    ``add_callbacks_post_trainer``, and axolotl adds it).
    """
    return callback_for(trainer, TrainerOptions.given("build_callback", drop_rate=drop_rate, **options))


def callback_for(trainer: Trainer, options: TrainerOptions) -> DropBPCallback:
    """:func:`build_callback` with its options as one (already valid) :class:`TrainerOptions`."""
    callback = DropBPCallback.from_options(options)
    callback._bind(trainer)
    return callback


def _checkpoint_folder(args: TrainingArguments, step: int) -> str:
    """Where the Trainer saves the checkpoint of ``step`` (and dropbp its state beside it)."""
    return os.path.join(args.output_dir, f"checkpoint-{step}")


def _first_batch(loader: Any) -> Any:
    """The first batch of the training data: its first examples in order, collated as the trainer does.

    Indexing the dataset draws nothing, so calibration leaves the data order and the random state of
    training as they were; an iterable dataset gives the first batch its loader yields.
    """
    base = getattr(loader, "base_dataloader", loader)  # Accelerate's wrapper: the torch DataLoader inside
    dataset, size = getattr(base, "dataset", None), getattr(base, "batch_size", None)
    if size is not None and hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        return base.collate_fn([dataset[i] for i in range(min(size, len(dataset)))])
    return next(iter(base))


def _to_device(batch: Any, device: Any) -> Any:
    if isinstance(batch, Mapping):
        return type(batch)({k: _to_device(v, device) for k, v in batch.items()})
    return batch.to(device) if hasattr(batch, "to") else batch


def _own_loss(model: Any, inputs: Mapping[str, Any]) -> Any:
    """The model's own loss on ``inputs`` (a batch with labels), as ``Trainer.compute_loss`` takes it."""
    outputs = model(**inputs)
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs[0]
    if loss is None:
        raise ValueError(
            "DropBPCallback calibrates with the model's own loss on the first training batch, and the model "
            "returned none (no labels in the batch?); use attach(trainer, ...) to calibrate with the trainer's "
            "compute_loss, or calibrate_at=None"
        )
    return loss


def _let_ddp_skip_unused_parameters(trainer: Trainer) -> None:
    """``find_unused_parameters=True`` for the DDP wrapper the trainer will build, unless the user chose.

    The Trainer builds its Accelerator's DDP settings in ``__init__``, so the Accelerator's handler is
    updated along with the argument. An explicit False is left alone: DropBP then stops at the first
    training forward with a message saying what to set (:mod:`dropbp.execution.distributed`).
    """
    if trainer.args.ddp_find_unused_parameters is not None:
        return
    trainer.args.ddp_find_unused_parameters = True
    handler = getattr(getattr(trainer, "accelerator", None), "ddp_handler", None)
    if handler is not None:
        handler.find_unused_parameters = True
