"""dropbp.integrations.hf with a real transformers.Trainer and trl.SFTTrainer (tiny llama + LoRA)."""

from __future__ import annotations

import json
import logging
import pydoc_data.topics

import pytest
import torch
from conftest import VOCAB, tiny_model, with_lora

import dropbp

transformers = pytest.importorskip("transformers")
from dropbp.integrations.hf import STATE_FILE, DropBPCallback, attach, callback_for  # noqa: E402
from dropbp.options import TrainerOptions  # noqa: E402

SEQ = 32


def _token_ids(n: int) -> list[list[int]]:
    """Byte-level ids of Python's own documentation, in the tiny vocabulary."""
    text = "".join(pydoc_data.topics.topics.values()).encode()
    ids = [3 + b % (VOCAB - 3) for b in text[: n * SEQ]]
    return [ids[i * SEQ : (i + 1) * SEQ] for i in range(n)]


def _dataset(n: int = 64) -> list[dict]:
    return [{"input_ids": torch.tensor(x), "labels": torch.tensor(x)} for x in _token_ids(n)]


def _args(tmp_path, **kw) -> transformers.TrainingArguments:
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=20,
        learning_rate=1e-3,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _trainer(tmp_path, callbacks=None, **kw) -> transformers.Trainer:
    return transformers.Trainer(
        model=with_lora(tiny_model("llama", layers=4)),
        args=_args(tmp_path, **kw),
        train_dataset=_dataset(),
        data_collator=transformers.default_data_collator,
        callbacks=callbacks,
    )


def _count_calibrations(callback) -> list[int]:
    calls: list[int] = []
    original = callback.controller.calibrate

    def counted(*a, **k):
        calls.append(callback.controller.step)
        return original(*a, **k)

    callback.controller.calibrate = counted
    return calls


def _check_logs(history: list[dict]) -> None:
    rates = [h for h in history if "dropbp/rate_mean" in h]
    drops = [h for h in history if "dropbp/dropped_branches" in h]
    assert len(rates) == 1 and rates[0]["step"] == 2  # 10% of 20 steps
    assert len(drops) == 4  # every logging step (5, 10, 15, 20)
    assert all(0 < h["dropbp/dropped_branches"] < 8 for h in drops)
    assert all(0 < h["dropbp/dropped_flops_fraction"] < 1 for h in drops)
    losses = [h["step"] for h in history if "loss" in h]
    assert losses == [5, 10, 15, 20]  # the Trainer's own loss log is still there at every logging step


def test_trainer_calibrates_once_and_logs(tmp_path):
    trainer = _trainer(tmp_path)
    callback = attach(trainer, drop_rate=0.5, pattern="uniform")
    calls = _count_calibrations(callback)
    trainer.train()
    assert len(calls) == 1 and callback.calibrated
    assert callback.controller.step == 20  # one pattern per training forward
    _check_logs(trainer.state.log_history)


def _sft_parts():
    """TRL, a word-level tokenizer over the tiny vocabulary, and a dataset of token ids (skips without TRL)."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"<{i}>": i for i in range(VOCAB)}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<3>")),
        pad_token="<0>",
        eos_token="<2>",
    )
    return trl, tok, datasets.Dataset.from_dict({"input_ids": _token_ids(64)})


def test_sft_trainer_calibrates_once_and_logs(tmp_path):
    trl, tok, data = _sft_parts()
    config = trl.SFTConfig(**_args(tmp_path).to_dict() | {"max_length": SEQ, "packing": False})
    trainer = trl.SFTTrainer(
        model=with_lora(tiny_model("llama", layers=4)), args=config, train_dataset=data, processing_class=tok
    )
    callback = attach(trainer, drop_rate=0.5, pattern="uniform")
    calls = _count_calibrations(callback)
    trainer.train()
    assert len(calls) == 1
    _check_logs(trainer.state.log_history)


def _record_patterns(callback, model=None) -> list[tuple[str, ...]]:
    """The pattern of every training forward of ``model`` (default: the trainer's); the callback's controller is
    looked up at each forward, so a callback that applies DropBP when training begins is recorded too."""
    seen: list[tuple[str, ...]] = []
    model = callback.trainer.model if model is None else model

    def record(module, args, output):
        if module.training and torch.is_grad_enabled() and callback.controller.forced is None:
            seen.append(callback.controller.last_dropped)

    model.register_forward_hook(record)
    return seen


def test_resume_continues_the_same_patterns(tmp_path):
    kw = dict(save_strategy="steps", save_steps=10, output_dir=str(tmp_path / "run"))
    full = _trainer(tmp_path, **kw)
    full_cb = attach(full, drop_rate=0.5)
    full_patterns = _record_patterns(full_cb)
    full.train()
    assert (tmp_path / "run" / "checkpoint-10" / STATE_FILE).is_file()

    resumed = _trainer(tmp_path, **kw)
    resumed_cb = attach(resumed, drop_rate=0.5, seed=123)  # the saved seed must win
    resumed_patterns = _record_patterns(resumed_cb)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-10"))
    assert len(full_patterns) == 20 and len(resumed_patterns) == 10
    assert resumed_patterns == full_patterns[10:]
    assert resumed_cb.controller.rates == full_cb.controller.rates
    assert resumed_cb.controller.seed == 0


def test_resume_continues_token_drop_rate_auto_with_its_shares(tmp_path):
    kw = dict(save_strategy="steps", save_steps=10, output_dir=str(tmp_path / "run"))
    full = _trainer(tmp_path, **kw)
    full_cb = attach(full, drop_rate=0.5, features=[dropbp.experimental.TokenDrops('auto')])
    full.train()
    resumed = _trainer(tmp_path, **kw)
    resumed_cb = attach(resumed, drop_rate=0.5, features=[dropbp.experimental.TokenDrops('auto')])
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-10"))
    want, got = full_cb.controller.state_dict()["token_drops"], resumed_cb.controller.state_dict()["token_drops"]
    assert got["shares"] == want["shares"] and min(want["shares"]) < 1.0  # rows were dropped, the same after resume
    for a, b in zip(got["readings"], want["readings"], strict=True):
        assert a == b if a is None else a == pytest.approx(b, abs=1e-5)
    assert set(full_cb.controller.features["token_drops"].keep_shares().values()) == set(want["shares"])
    logged = [e for e in full.state.log_history if "dropbp/token_keep_share" in e]
    assert logged and logged[-1]["dropbp/token_keep_min"] == min(want["shares"])


def test_gradient_accumulation_draws_per_micro_batch(tmp_path):
    trainer = _trainer(tmp_path, gradient_accumulation_steps=2, max_steps=5)
    callback = attach(trainer, drop_rate=0.5, calibrate_at=None, pattern="uniform")
    patterns = _record_patterns(callback)
    trainer.train()
    assert callback.controller.step == 10 and len(patterns) == 10
    assert callback.controller.rates == [0.5] * 8  # no calibration asked for


def test_lora_on_attention_only_never_crashes(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("llama", layers=2), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    trainer = transformers.Trainer(
        model=model,
        args=_args(tmp_path, max_steps=40),
        train_dataset=_dataset(),
        data_collator=transformers.default_data_collator,
    )
    attach(trainer, drop_rate=0.5, calibrate_at=None)
    trainer.train()  # one step in six would drop both attention branches without the guard
    assert trainer.state.global_step == 40


def test_attach_again_after_removing_the_first(tmp_path):
    """The refusal of a second attach says to remove the first controller; doing so takes its callback off the
    trainer too, so the new one trains alone (and a removed one leaves a plain Trainer)."""
    trainer = _trainer(tmp_path, max_steps=4)
    first = attach(trainer, drop_rate=0.5)
    with pytest.raises(RuntimeError, match=r"already attached.*call \.remove\(\) on the existing controller"):
        attach(trainer, drop_rate=0.25)
    first.controller.remove()
    assert first not in trainer.callback_handler.callbacks
    second = attach(trainer, drop_rate=0.25)
    trainer.train()
    assert [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, type(second))] == [second]
    assert second.controller.step == 4 and first.controller.step == 0
    second.controller.remove()
    trainer.train()  # no DropBP left: trains as a plain Trainer
    assert second.controller.step == 4


def test_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="trainer must be a transformers.Trainer, got object"):
        attach(object())
    with pytest.raises(ValueError, match="calibrate_at must be a fraction of the training steps"):
        attach(_trainer(tmp_path), calibrate_at=2)
    with pytest.raises(ValueError, match="drop_rate must be in"):
        attach(_trainer(tmp_path), drop_rate=1.5)
    with pytest.raises(ValueError, match=r"calibrate_at=0.1 needs pattern='uniform'.*or calibrate_at=None"):
        attach(_trainer(tmp_path), calibrate_at=0.1)
    with pytest.raises(ValueError, match="pattern must be one of"):
        attach(_trainer(tmp_path), pattern="random")


def test_default_is_cut_patterns_without_calibration(tmp_path):
    trainer = _trainer(tmp_path)
    callback = attach(trainer, drop_rate=0.5)
    ctl = callback.controller
    assert ctl.pattern == "cut" and callback.calibrate_at is None
    trainer.train()
    # not calibrated: the cut's own rates for 0.5 under the run's schedule (20 forwards, warm-up over 4)
    assert (ctl.total_steps, ctl.warmup_steps) == (20, 4)
    own = dropbp.apply(tiny_model("llama", layers=4), 0.5, backend="cpu", warmup_steps=4, total_steps=20)
    assert ctl.rates == own.rates
    assert not any("dropbp/rate_mean" in entry for entry in trainer.state.log_history)
    assert any("dropbp/dropped_branches" in entry for entry in trainer.state.log_history)


def test_trainer_optimizer_sees_filled_gradients_of_dropped_branches(tmp_path):
    """With DroppedGradFill("zero") the Trainer's optimizer (after clipping) gets a zero gradient for
    every trainable parameter of a dropped branch instead of none."""
    trainer = _trainer(tmp_path, max_steps=6, max_grad_norm=1.0)
    fill = dropbp.experimental.DroppedGradFill("zero")
    callback = callback_for(trainer, TrainerOptions(0.5, calibrate_at=None, features=[fill]))
    trainer.add_callback(callback)
    ctl = callback.controller
    seen: list[tuple[tuple[str, ...], list[bool]]] = []

    class Watch(transformers.TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kw):
            for b in ctl.branches:
                if b.name in ctl.last_dropped:
                    grads = [p.grad for p in b.module.parameters() if p.requires_grad]
                    seen.append((b.name, [g is not None and not g.any() for g in grads]))

    trainer.add_callback(Watch())
    trainer.train()
    assert len(seen) >= 6 and all(all(zeros) and zeros for _, zeros in seen)


def test_warmup_fraction_becomes_training_forwards(tmp_path):
    trainer = _trainer(tmp_path, max_steps=5, gradient_accumulation_steps=2)
    callback = attach(trainer, drop_rate=0.5, calibrate_at=None, warmup=0.4)
    patterns = _record_patterns(callback)
    trainer.train()
    assert callback.controller.warmup_steps == 4  # 0.4 x 5 steps x 2 micro-batches
    assert patterns[0] == ()  # the first forward runs full backprop
    not_a_fraction = r"warmup must be a fraction of the training steps \(or .auto.\) in \[0, 1\), got 1.5"
    with pytest.raises(ValueError, match=not_a_fraction):
        attach(_trainer(tmp_path), warmup=1.5)


def test_auto_warmup_is_shortened_where_a_high_rate_cannot_keep_its_mean(tmp_path, caplog):
    """At 0.875 the cut cannot pay for a 20% warm-up (the top branch is always kept): warmup="auto" takes
    the longest that fits, says so, and the run's mean rate is still the drop rate; a warm-up asked for is
    refused instead."""
    trainer = _trainer(tmp_path, max_steps=25, gradient_accumulation_steps=2)
    callback = attach(trainer, drop_rate=0.875, calibrate_at=None)
    assert callback.options.warmup == "auto" and callback.warmup == 0.2
    with caplog.at_level(logging.WARNING, logger="dropbp"):
        trainer.train()
    ctl = callback.controller
    assert 0 < ctl.warmup_steps < 10 and ctl.total_steps == 50  # 20% of 25 steps x 2 micro-batches is 10
    assert sum(ctl.schedule.drop_rate_at(s) for s in range(50)) / 50 == pytest.approx(0.875, abs=1e-9)
    with pytest.raises(ValueError, match="cannot take"):
        ctl.warmup_steps += 1  # one forward longer is refused: the longest that fits was taken
    (warning,) = [r.getMessage() for r in caplog.records if "warm-up shortened" in r.getMessage()]
    assert warning.startswith(f"dropbp: warm-up shortened from 10 to {ctl.warmup_steps} of the run's 50")
    assert "Pass warmup= to choose (0: none)" in warning

    asked = _trainer(tmp_path, max_steps=25, gradient_accumulation_steps=2)
    attach(asked, drop_rate=0.875, calibrate_at=None, warmup=0.2)
    with pytest.raises(ValueError, match=r"shorten the warm-up \(apply's warmup_steps, attach's warmup=\)"):
        asked.train()
    with pytest.raises(TypeError, match=r"warmup must be a fraction of the training steps \(or \"auto\"\)"):
        attach(_trainer(tmp_path), warmup="longest")


def test_chunked_loss_trains_as_the_plain_loss(tmp_path):
    """attach(chunked_loss=True): the Trainer (gradient accumulation: num_items_in_batch) ends with the
    same weights as the plain loss, with the same patterns."""
    weights = []
    for chunked in (False, True):
        trainer = _trainer(tmp_path, max_steps=3, gradient_accumulation_steps=2)
        features = [dropbp.ChunkedLoss()] if chunked else []
        callback = attach(trainer, 0.5, calibrate_at=None, warmup=0.0, pattern="uniform", features=features)
        assert ("chunked_loss" in callback.controller.features) == chunked
        trainer.train()
        weights.append({n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad})
    for name, want in weights[0].items():
        torch.testing.assert_close(weights[1][name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


# -- DropBPCallback given to the trainer when it is made: the same run as attach ----------------------------------
def _logs(history: list[dict]) -> list[dict]:
    """``log_history`` without its timings: every entry's keys, and every DropBP value."""
    return [
        {k: (v if k.startswith("dropbp/") or k in ("step", "epoch") else None) for k, v in h.items()} for h in history
    ]


def _run(trainer, callback, resume=None):
    patterns = _record_patterns(callback, trainer.model)
    trainer.train(resume_from_checkpoint=resume)
    return patterns


def _saved(folder) -> list[str]:
    return sorted(p.read_text() for p in folder.rglob(STATE_FILE))


@pytest.mark.parametrize("pattern", ["uniform", "cut"])
def test_callback_at_construction_trains_as_attach(tmp_path, pattern):
    """``Trainer(callbacks=[DropBPCallback(...)])`` under gradient accumulation: the patterns of every
    micro-batch, the calibrated rates, the log entries and the checkpoints' DropBP state are attach's."""
    kw = dict(gradient_accumulation_steps=2, max_steps=10, logging_steps=2, save_strategy="steps", save_steps=5)
    attached = _trainer(tmp_path, output_dir=str(tmp_path / "a"), **kw)
    by_attach = attach(attached, 0.5, pattern=pattern, warmup=0.2)
    want = _run(attached, by_attach)

    callback = DropBPCallback(drop_rate=0.5, pattern=pattern, warmup=0.2)
    built = _trainer(tmp_path, callbacks=[callback], output_dir=str(tmp_path / "b"), **kw)
    assert callback.controller is None  # nothing applied before training begins
    got = _run(built, callback)
    assert len(want) == 20 and got == want
    assert callback.controller.state_dict() == by_attach.controller.state_dict()
    assert callback.calibrated == by_attach.calibrated == (pattern == "uniform")
    assert _logs(built.state.log_history) == _logs(attached.state.log_history)
    assert _saved(tmp_path / "b") == _saved(tmp_path / "a") and len(_saved(tmp_path / "a")) == 2


def test_callback_at_construction_resumes_with_the_same_patterns(tmp_path):
    kw = dict(save_strategy="steps", save_steps=10, output_dir=str(tmp_path / "run"))
    full = _trainer(tmp_path, **kw)
    want = _run(full, attach(full, drop_rate=0.5))
    callback = DropBPCallback(drop_rate=0.5, seed=123)  # the saved seed must win
    resumed = _trainer(tmp_path, callbacks=[callback], **kw)
    got = _run(resumed, callback, resume=str(tmp_path / "run" / "checkpoint-10"))
    assert len(got) == 10 and got == want[10:]
    assert callback.controller.seed == 0 and callback.controller.step == 20


def test_callback_at_construction_in_sft_trainer_trains_as_attach(tmp_path):
    trl, tok, data = _sft_parts()
    runs = []
    for how in ("attach", "callback"):
        config = trl.SFTConfig(
            **_args(tmp_path, output_dir=str(tmp_path / how), gradient_accumulation_steps=2).to_dict()
            | {"max_length": SEQ, "packing": False}
        )
        callback = DropBPCallback(drop_rate=0.5, pattern="uniform") if how == "callback" else None
        model = with_lora(tiny_model("llama", layers=4))
        trainer = trl.SFTTrainer(
            model=model,
            args=config,
            train_dataset=data,
            processing_class=tok,
            callbacks=[callback] if callback else None,
        )
        if callback is None:
            callback = attach(trainer, drop_rate=0.5, pattern="uniform")
        patterns = _run(trainer, callback)
        runs.append((patterns, callback.controller.state_dict(), _logs(trainer.state.log_history)))
        _check_logs(trainer.state.log_history)
    assert len(runs[0][0]) == 40 and runs[1] == runs[0]


def test_callback_options_are_checked_when_it_is_made():
    with pytest.raises(ValueError, match=r"calibrate_at=0.1 needs pattern='uniform'"):
        DropBPCallback(calibrate_at=0.1)
    with pytest.raises(TypeError, match=r"DropBPCallback\(\) does not take total_steps: the run decides it"):
        DropBPCallback(total_steps=100)
    with pytest.raises(TypeError, match=r"attach\(\) does not take warmup_steps: .*pass warmup="):
        attach(object(), warmup_steps=10)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'drop_rates'; its options are drop_rate, seed"):
        DropBPCallback(drop_rates=0.5)
    with pytest.raises(ValueError, match=r"drop_rate must be in \[0, 1\), got 1.5"):
        DropBPCallback(1.5)


def test_callback_at_construction_calibrates_with_the_models_own_loss_or_says_why(tmp_path):
    """Without labels the model has no loss of its own: the calibration says so, and what to do."""
    callback = DropBPCallback(drop_rate=0.5, pattern="uniform")
    trainer = transformers.Trainer(
        model=with_lora(tiny_model("llama", layers=4)),
        args=_args(tmp_path),
        train_dataset=[{"input_ids": torch.tensor(x)} for x in _token_ids(64)],
        data_collator=transformers.default_data_collator,
        callbacks=[callback],
    )
    trainer.compute_loss = lambda model, inputs, **kw: model(**inputs, labels=inputs["input_ids"]).loss
    with pytest.raises(ValueError, match=r"returned none \(no labels in the batch\?\); use attach\(trainer"):
        trainer.train()


def test_removing_the_controller_leaves_a_construction_callback_idle(tmp_path):
    """The Trainer does not tell a callback given to its constructor which handler holds it (and dropbp inspects no
    frames to find out), so remove() leaves it on the trainer, idle: the next run is plain."""
    callback = DropBPCallback(drop_rate=0.5)
    trainer = _trainer(tmp_path, callbacks=[callback], max_steps=4, logging_steps=2)
    trainer.train()
    callback.controller.remove()
    assert callback in trainer.callback_handler.callbacks
    assert any(k.startswith("dropbp/") for entry in trainer.state.log_history for k in entry)
    trainer.train()  # a plain Trainer again (train() starts a new state)
    assert callback.controller.step == 4 and trainer.state.log_history
    assert not any(k.startswith("dropbp/") for entry in trainer.state.log_history for k in entry)


def test_a_construction_callback_says_where_its_figures_go_when_report_to_names_loggers(tmp_path, caplog):
    """A callback the Trainer's constructor holds cannot reach the loggers of ``report_to`` (it is not told its
    trainer): said at the start, with what to do."""
    args = _args(tmp_path, max_steps=2)
    args.report_to = ["wandb"]  # set after the arguments are checked: no wandb needed to see the message
    callback = DropBPCallback(drop_rate=0.5)
    with caplog.at_level("WARNING", logger="dropbp"):
        callback.on_train_begin(
            args, transformers.TrainerState(max_steps=2), transformers.TrainerControl(), model=_trainer(tmp_path).model
        )
    assert "go to trainer.state.log_history and the 'dropbp' logger only" in caplog.text
    assert "To see them in wandb, apply it with dropbp.attach(trainer, ...)" in caplog.text
    caplog.clear()
    attached = attach(_trainer(tmp_path, report_to=[]), drop_rate=0.5)
    attached.on_train_begin(args, transformers.TrainerState(max_steps=2), transformers.TrainerControl())
    assert "log_history" not in caplog.text  # attach knows the trainer: its loggers get the figures


def test_the_callback_logs_the_noise_scale_it_measures(tmp_path, caplog):
    """``measure_noise_scale=True`` with gradient accumulation: every logging step after the first closed optimizer
    step carries ``dropbp/noise_scale`` (tokens) and ``dropbp/noise_ratio``, the controller's own figures; once
    enough steps are measured, the forecast per arm is logged once. At rate 0 (steps that drop a branch are not read:
    said once, below)."""
    callback = DropBPCallback(0.0, features=[dropbp.NoiseScale()])
    trainer = _trainer(tmp_path, callbacks=[callback], gradient_accumulation_steps=2, max_steps=10, logging_steps=2)
    with caplog.at_level(logging.INFO, logger="dropbp"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "gradient noise scale" in r.getMessage()]
    assert len(said) == 2 and all("128 tokens per step" in m for m in said)  # before the first step; after 4 steps
    assert said[0].startswith("dropbp: before the first step, on 8 micro-batches of this run's data")
    assert all("branch drops at 0.5:" in m and "full backprop at half the batch:" in m for m in said)
    logged = [h for h in trainer.state.log_history if "dropbp/noise_scale" in h]
    assert [h["step"] for h in logged] == [2, 4, 6, 8, 10]
    final = callback.controller.features["noise_scale"].estimate()
    assert final.tokens_per_step == 2 * 2 * SEQ and final.steps == 10  # each step closes at its on_step_end
    assert logged[-1]["dropbp/noise_scale"] == final.tokens
    assert logged[-1]["dropbp/noise_ratio"] == pytest.approx(final.tokens / final.tokens_per_step)
    dropping = DropBPCallback(0.5, warmup=0, features=[dropbp.NoiseScale()])
    trainer = _trainer(tmp_path, callbacks=[dropping], gradient_accumulation_steps=2, max_steps=4)
    with pytest.warns(UserWarning, match="not read from optimizer steps that drop a branch's backward"):
        trainer.train()
    assert dropping.controller.features["noise_scale"].estimate() is None


def test_the_start_forecast_reads_the_runs_data_and_leaves_the_run_as_it_was(tmp_path, caplog, monkeypatch):
    """With the noise scale measured, the forecast at the start comes from the run's own data before the first step
    (instead of the map's nearest cell), and the run trains exactly as it does without that reading: same data
    order, same patterns, same weights."""
    from dropbp.integrations import hf

    def trained(start_windows: int):
        monkeypatch.setattr(hf, "START_WINDOWS", start_windows)
        callback = DropBPCallback(0.5, features=[dropbp.NoiseScale()])
        trainer = _trainer(tmp_path, callbacks=[callback], gradient_accumulation_steps=2, max_steps=6)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dropbp"):
            trainer.train()
        return trainer, [r.getMessage() for r in caplog.records]

    read, said = trained(hf.START_WINDOWS)
    assert any(m.startswith("dropbp: before the first step, on 8 micro-batches") for m in said)
    assert not any("nearest the measured regime" in m for m in said)
    plain, said = trained(0)  # no start reading: the map's forecast, as without measure_noise_scale
    assert any("nearest the measured regime" in m for m in said)
    assert [h.get("loss") for h in read.state.log_history] == [h.get("loss") for h in plain.state.log_history]
    for (name, a), (_, b) in zip(read.model.named_parameters(), plain.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_a_checkpoint_holds_the_noise_scale_of_every_step_before_it(tmp_path):
    """Each optimizer step's window closes at its end (on_step_end), so the state a checkpoint saves holds every
    step so far, and a run resumed under drop_rate="auto" continues as the uninterrupted one (it dropped nothing where
    the uninterrupted run dropped: the checkpoint was a step short)."""
    kw = dict(save_strategy="steps", save_steps=6, output_dir=str(tmp_path / "run"), gradient_accumulation_steps=2,
              max_steps=10)  # fmt: skip
    full = _trainer(tmp_path, **kw)
    full_cb = attach(full, drop_rate="auto", seed=1)
    full.train()
    saved = json.loads((tmp_path / "run" / "checkpoint-6" / STATE_FILE).read_text())["controller"]
    assert saved["noise_scale"]["steps"] == 6
    resumed = _trainer(tmp_path, **kw)
    resumed_cb = attach(resumed, drop_rate="auto", seed=1)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-6"))
    want = full_cb.controller.features["noise_scale"].estimate()
    got = resumed_cb.controller.features["noise_scale"].estimate()
    assert got.steps == want.steps == 10 and got.tokens == pytest.approx(want.tokens, rel=1e-4)
    assert resumed_cb.controller.rates == full_cb.controller.rates


@pytest.mark.parametrize("rate", [0.5, "auto"])
def test_one_micro_batch_per_step_is_read_from_within_each_step(tmp_path, caplog, rate):
    trainer = _trainer(tmp_path, max_steps=3)
    with caplog.at_level(logging.INFO, logger="dropbp"):
        callback = attach(trainer, drop_rate=rate, features=[dropbp.NoiseScale()])
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "gradient_accumulation_steps=1" in r.getMessage()]
    assert len(said) == 1 and "read from within each step" in said[0]
    assert callback.controller.features["noise_scale"].estimate().steps >= 2  # the last closes at the next forward


@pytest.mark.parametrize("rate", [0.5, "auto"])
def test_one_micro_batch_per_step_without_an_output_layer_says_the_noise_scale_measures_nothing(
    tmp_path, caplog, rate
):
    trainer = _trainer(tmp_path, max_steps=2)
    trainer.model.get_output_embeddings = lambda: None  # a model whose output layer cannot be found
    with caplog.at_level(logging.WARNING, logger="dropbp"):
        callback = attach(trainer, drop_rate=rate, features=[dropbp.NoiseScale()])
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "gradient_accumulation_steps=1" in r.getMessage()]
    assert len(said) == 1 and "nothing will be measured" in said[0] and "get_output_embeddings()" in said[0]
    assert ('"auto" stays at full backprop' in said[0]) == (rate == "auto")
    assert callback.controller.features["noise_scale"].estimate() is None
