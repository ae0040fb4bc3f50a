"""Random Trainer runs, as users make them (reliability round 5, classes A and B, drawn): ``attach``, a callback given
to the constructor or a ``model_init`` Trainer; the CPU or the lazy-graph backend; gradient accumulation 1, 2 or 4
over epochs whose length is or is not a multiple of it (transformers' short last windows); a run of epochs or of
``max_steps``; ``train()`` again; a run saved and resumed by a Trainer on another backend whose callback asks for
other settings. After every run: DropBP is on the model that trained, its step counter and schedule span exactly the
forwards the run made (counted here by simulating the Trainer's windows), the run's mean drop rate is the one asked
for, the patterns drawn are the controller's for those forwards, the lazy device's pattern bound holds whatever the
state came from, and under ``stratify`` every optimizer step keeps each branch whose rate allows it."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import attach_experimental, tiny_model

hypothesis = pytest.importorskip("hypothesis")
transformers = pytest.importorskip("transformers")
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule  # noqa: E402
from test_hf_integration import _args, _dataset  # noqa: E402

from dropbp.controller import controller_of  # noqa: E402
from dropbp.integrations.hf import DropBPCallback  # noqa: E402
from dropbp.tools.arms import arm_features  # noqa: E402

LAZY_BOUND = 16  # the lazy backend's pattern bound (backends.lazy: default_max_patterns)


def windows_of(batches: int, accumulation: int, optimizer_steps: int) -> list[int]:
    """The forwards of each optimizer step the Trainer makes, simulated: epochs of ``batches`` micro-batches cut into
    windows of ``accumulation``, the last window of an epoch short where it does not divide."""
    sizes: list[int] = []
    while len(sizes) < optimizer_steps:
        for start in range(0, batches, accumulation):
            if len(sizes) == optimizer_steps:
                break
            sizes.append(min(accumulation, batches - start))
    return sizes


class Recorder(transformers.TrainerCallback):
    """The branches each training forward of the trained model dropped, per ``train()`` (a forward that draws no
    pattern, as calibration's measuring one, is not a training forward of the schedule)."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[str, ...]] = {}
        self._handle = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self._handle is not None:
            self._handle.remove()
        self.seen = {}
        self._handle = model.register_forward_hook(self._record)

    def _record(self, module, args, out) -> None:
        ctl = controller_of(module)
        if module.training and torch.is_grad_enabled() and ctl.step - 1 not in self.seen:
            self.seen[ctl.step - 1] = ctl.last_dropped


class TrainerRuns(RuleBasedStateMachine):
    @initialize(
        how=st.sampled_from(["attach", "callback", "model_init"]),
        backend=st.sampled_from(["cpu", "lazy"]),
        accumulation=st.sampled_from([1, 2, 4]),
        batches=st.sampled_from([12, 13, 15]),
        pattern=st.sampled_from(["cut", "uniform"]),
        drop_rate=st.sampled_from([0.5, 0.75]),
        stratified=st.booleans(),
        warmup=st.sampled_from([0, "auto"]),
    )
    def build(self, how, backend, accumulation, batches, pattern, drop_rate, stratified, warmup) -> None:
        self.how, self.backend, self.accumulation, self.batches = how, backend, accumulation, batches
        stratify = accumulation if stratified and pattern == "cut" and backend == "cpu" and accumulation > 1 else 1
        self.options = dict(drop_rate=drop_rate, pattern=pattern, stratify=stratify, warmup=warmup, backend=backend)
        self.trainer, self.callback, self.recorder = self._trainer(self.options)

    def _trainer(self, options: dict, output_dir: str | None = None):
        recorder = Recorder()
        folder = output_dir or tempfile.mkdtemp(prefix="dropbp-runs-")
        args = _args(Path(folder), gradient_accumulation_steps=self.accumulation, output_dir=folder, logging_steps=1000)
        made = dict(model_init=lambda: tiny_model("llama", layers=3)) if self.how == "model_init" else {}
        if self.how == "callback":  # the results tables' flat names made into their features
            rest, features = arm_features(options)
            callback = DropBPCallback(**rest, features=features)
        else:
            callback = None
        trainer = transformers.Trainer(
            model=None if made else tiny_model("llama", layers=3),
            args=args,
            train_dataset=_dataset(2 * self.batches),
            data_collator=transformers.default_data_collator,
            callbacks=[recorder] + ([callback] if callback else []),
            **made,
        )
        if callback is None:
            callback = attach_experimental(trainer, **options)
        return trainer, callback, recorder

    def _length(self, trainer, epochs: int | None, steps: int | None) -> int:
        """Set the run's length; return its optimizer steps."""
        if epochs is not None:
            trainer.args.max_steps, trainer.args.num_train_epochs = -1, epochs
            return epochs * math.ceil(self.batches / self.accumulation)
        trainer.args.max_steps = steps
        return steps

    @rule(epochs=st.sampled_from([None, 1, 2]), steps=st.integers(3, 9))
    def train(self, epochs, steps) -> None:
        """A new run from step 0: the first, ``train()`` again, or a new model of ``model_init``."""
        optimizer_steps = self._length(self.trainer, epochs, None if epochs else steps)
        self.trainer.args.save_strategy = "no"
        self.trainer.train()
        self._check_run(self.trainer, self.callback, self.recorder, optimizer_steps, resumed_at=0)

    @precondition(lambda self: self.how != "model_init")
    @rule(
        backend=st.sampled_from(["cpu", "lazy"]),
        asked=st.sampled_from([{}, {"drop_rate": 0.75}, {"pattern": "uniform"}, {"max_patterns": 4}]),
        steps=st.integers(6, 9),
    )
    def resume_elsewhere(self, backend, asked, steps) -> None:
        """A run saved every 3 steps, resumed from its first checkpoint by a new Trainer on ``backend`` whose callback
        asks for ``asked``: the callback's settings and the device's bound are in force, the count continues."""
        first = self.trainer
        first.args.save_strategy, first.args.save_steps = "steps", 3
        self._length(first, None, steps)
        first.train()
        options = {**self.options, "backend": backend, **asked}
        if backend == "lazy" or options["pattern"] != "cut" or "max_patterns" in asked:
            options["stratify"] = 1  # stratified cuts are drawn afresh: no pool
        trainer, callback, recorder = self._trainer(options, output_dir=first.args.output_dir)
        self._length(trainer, None, steps)
        trainer.train(resume_from_checkpoint=os.path.join(first.args.output_dir, "checkpoint-3"))
        ctl = callback.controller
        for name, value in options.items():
            if name == "stratify":
                assert ("stratified_cuts" in ctl.features) == (value > 1)
            elif name not in ("warmup", "backend"):
                assert getattr(ctl.options, name) == value, (name, value)
        self._check_run(trainer, callback, recorder, steps, resumed_at=3)
        self.trainer, self.callback, self.recorder, self.backend = trainer, callback, recorder, backend
        self.options = options

    def _check_run(self, trainer, callback, recorder, optimizer_steps: int, resumed_at: int) -> None:
        ctl = callback.controller
        sizes = windows_of(self.batches, self.accumulation, optimizer_steps)
        forwards, done = sum(sizes), sum(sizes[:resumed_at])
        assert controller_of(trainer.model) is ctl  # DropBP on the model that trained (model_init: the new one)
        # calibration's measuring forward (it draws nothing) before the run's first is recorded at done - 1
        recorder.seen.pop(done - 1, None)
        assert ctl.step == forwards and sorted(recorder.seen) == list(range(done, forwards))
        assert ctl.total_steps == forwards
        if not callback.calibrated:  # (calibration replaces the rates: earlier forwards drew with the shape's own)
            assert all(dropped == ctl.dropped_at(s) for s, dropped in recorder.seen.items())
            assert ctl.schedule.mean_drop_rate(0, forwards) == pytest.approx(ctl.drop_rate, abs=1e-6)
        if ctl.backend.name == "lazy":
            assert ctl.max_patterns is not None and ctl.max_patterns <= LAZY_BOUND
            assert len(set(recorder.seen.values())) <= ctl.max_patterns
        expected_windows = None if self.batches % self.accumulation == 0 else (self.batches, self.accumulation)
        assert ctl.windows == expected_windows
        if "stratified_cuts" in ctl.features and ctl.warmup_steps == 0:
            names = [b.name for b in ctl.branches]
            start = 0
            for m in sizes:
                step = [recorder.seen.get(s) for s in range(start, start + m)]
                if start >= done:
                    for name, rate in zip(names, ctl.rates, strict=True):
                        assert rate > 1 - 1 / m or any(name not in dropped for dropped in step), (name, m, step)
                start += m


TrainerRuns.TestCase.settings = settings(
    max_examples=12, stateful_step_count=3, deadline=None, derandomize=True, print_blob=True
)
test_trainer_runs = TrainerRuns.TestCase
