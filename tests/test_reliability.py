"""Reliability, round 3: interrupts, leaks, merged adapters, branches in eval, bounded caches, resumed runs of
another length, tampered state. Every gradient is held against a hand-detached reference (a clean copy of the
model, its branch outputs detached by plain hooks, no dropbp)."""

from __future__ import annotations

import copy
import gc
import logging
import re
import weakref

import pytest
import torch
from conftest import (
    assert_same_grads,
    attach_experimental,
    batch,
    detach_outputs,
    loss_and_grads,
    tiny_model,
    with_lora,
)

import dropbp
from dropbp.controller import controller_of
from dropbp.policy.sampler import PatternSampler
from dropbp.tools.arms import apply_arm


@pytest.fixture(autouse=True)
def _grad_mode_back():
    """A failing case must not leave grad mode off for the tests after it."""
    yield
    torch.set_grad_enabled(True)


def _dropbp_hooked(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every module carrying a forward hook of dropbp's."""
    found = []
    for name, m in model.named_modules():
        hooks = [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]
        if any(fn.__module__.startswith("dropbp") for fn in hooks):
            found.append((name, m))
    return found


def _exact_step(model, reference, ctl, ids) -> None:
    """One training step of ``model`` has exactly the gradients of the reference with its pattern detached."""
    loss, grads = loss_and_grads(model, ids)
    handles = detach_outputs(reference, ctl.last_dropped)
    ref_loss, ref_grads = loss_and_grads(reference, ids)
    for h in handles:
        h.remove()
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
    assert_same_grads(grads, ref_grads)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("where", ["after its pre-hooks", "before its post-hooks"])
def test_an_interrupt_at_any_hooked_module_leaves_grad_mode_as_it_found_it(where, checkpointing):
    model = tiny_model("llama", layers=3)
    reference = copy.deepcopy(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ctl = dropbp.apply(model, 0.5, seed=0, pattern="uniform")
    ids = batch(0)
    hooked = _dropbp_hooked(model)
    assert len(hooked) >= 1 + len(ctl.branches)

    def interrupt(*args):
        raise KeyboardInterrupt

    interrupted_dropped = 0
    for name, module in hooked:
        for _ in range(3):  # a few steps each: the module dropped in some of them
            if where == "after its pre-hooks":
                handle = module.register_forward_pre_hook(interrupt)
            else:
                handle = module.register_forward_hook(interrupt, prepend=True)
            with pytest.raises(KeyboardInterrupt):
                model(input_ids=ids, labels=ids)
            handle.remove()
            interrupted_dropped += name in ctl.last_dropped
            assert torch.is_grad_enabled(), f"grad mode left off by an interrupt at {name} ({where})"
            _exact_step(model, reference, ctl, ids)
    assert interrupted_dropped > 0  # the case of the bug: an interrupt inside a dropped branch


def test_a_model_with_a_controller_and_no_remove_is_garbage_collected():
    model = tiny_model("llama", layers=3)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ctl = dropbp.apply(model, 0.5, seed=0)
    for step in range(3):
        loss_and_grads(model, batch(step))
    pending = model(input_ids=batch(9), labels=batch(9)).loss  # a forward whose backward never comes
    refs = [weakref.ref(model), weakref.ref(ctl), weakref.ref(ctl.branches[0].module)]
    del model, ctl, pending
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_apply_without_keeping_the_controller_still_finds_it():
    model = tiny_model("llama", layers=2)
    dropbp.apply(model, 0.5, seed=0)
    gc.collect()
    ctl = controller_of(model)
    assert ctl is not None and ctl.drop_rate == 0.5
    with pytest.raises(RuntimeError, match="already attached"):
        dropbp.apply(model, 0.5)


def test_merge_and_unload_after_training_trains_every_branch():
    model = with_lora(tiny_model("llama", layers=3))
    ctl = dropbp.apply(model, 0.5, seed=0, pattern="uniform")
    for step in range(3):
        loss_and_grads(model, batch(step))
    assert ctl.last_dropped
    merged = model.merge_and_unload()
    for p in merged.parameters():
        p.requires_grad_(True)
    reference = copy.deepcopy(merged)  # a copy is clean: no dropbp hooks
    step = ctl.step
    with pytest.warns(UserWarning, match="outside a forward of the model dropbp was applied to"):
        _, grads = loss_and_grads(merged, batch(5))
    _, ref_grads = loss_and_grads(reference, batch(5))
    assert_same_grads(grads, ref_grads)
    assert all(g is not None for g in grads.values())
    assert ctl.step == step  # the merged model's forwards are not the controlled model's steps


def test_the_backbone_called_directly_drops_nothing():
    model = tiny_model("llama", layers=3)
    reference = copy.deepcopy(model)
    ctl = dropbp.apply(model, 0.5, seed=0, pattern="uniform")
    ids = batch(1)
    model(input_ids=ids, labels=ids)  # a full forward: its pattern must not follow the backbone's call
    assert ctl.last_dropped
    with pytest.warns(UserWarning, match="called directly"):
        model.model(input_ids=ids).last_hidden_state.square().mean().backward()
    reference.model(input_ids=ids).last_hidden_state.square().mean().backward()
    got = {n: p.grad for n, p in model.model.named_parameters()}
    want = {n: p.grad for n, p in reference.model.named_parameters()}
    assert_same_grads(got, want)


def test_a_branch_module_left_in_eval_drops_as_reported():
    model = tiny_model("llama", layers=3)
    reference = copy.deepcopy(model)
    ctl = dropbp.apply(model, 0.5, seed=0, pattern="uniform")
    first = ctl.branches[0]
    first.module.eval()
    reference.get_submodule(first.name).eval()
    seen_dropped = 0
    for step in range(8):
        _exact_step(model, reference, ctl, batch(step))
        seen_dropped += first.name in ctl.last_dropped
    assert seen_dropped > 0


def test_a_long_warmup_keeps_a_bounded_number_of_samplers():
    model = tiny_model("llama", layers=3)
    ctl = dropbp.apply(model, 0.5, seed=0, warmup_steps=10_000)
    gc.collect()
    before = sum(isinstance(o, PatternSampler) for o in gc.get_objects())
    for step in range(10_000):
        ctl.dropped_at(step)
    gc.collect()
    built = sum(isinstance(o, PatternSampler) for o in gc.get_objects()) - before
    assert built <= 32
    assert ctl.dropped_at(7_000) == ctl.dropped_at(7_000)  # rebuilt alike


STATE_TAMPERING = [
    ({"drop_rate": "0.5"}, TypeError, r"state\['drop_rate'\] must be a number"),
    ({"drop_rate": None}, TypeError, r"state\['drop_rate'\]"),
    ({"drop_rate": True}, TypeError, r"state\['drop_rate'\]"),
    ({"branches": 5}, TypeError, r"state\['branches'\] must be a list"),
    ({"seed": "1"}, TypeError, r"state\['seed'\]"),
    ({"rates": 0.5}, TypeError, r"state\['rates'\]"),
    ({"rates": ["x"] * 6}, TypeError, r"state\['rates'\]\[0\]"),
    ({"step": -1}, ValueError, r"state\['step'\]"),
    ({"warmup_steps": 2.5}, TypeError, r"state\['warmup_steps'\]"),
    ({"total_steps": "100"}, TypeError, r"state\['total_steps'\]"),
    ({"pattern": "cuts"}, ValueError, r"state\['pattern'\]"),
    ({"ramp": 0.5}, ValueError, r"keys dropbp does not know: 'ramp'"),  # 0.3's, in a 0.4 state
    ({"version": 1, "drop_schedule": "linear", "ramp": 0, "stratify": 1}, ValueError, r"ramp must be a fraction"),
    ({"version": 1, "drop_schedule": "constant", "ramp": 0.5, "stratify": 0}, ValueError, r"stratify=0: pass"),
    ({"warmup_step": 5}, ValueError, r"'warmup_step' \(did you mean 'warmup_steps'\?\)"),
    ({"colour": "red"}, ValueError, r"keys dropbp does not know: 'colour'"),
]


@pytest.mark.parametrize(("change", "error", "message"), STATE_TAMPERING)
def test_tampered_state_is_refused_naming_the_field_and_changes_nothing(change, error, message):
    model = tiny_model("llama", layers=3)
    ctl = dropbp.apply(model, 0.5, seed=0, pattern="uniform")
    loss_and_grads(model, batch(0))
    before = ctl.state_dict()
    with pytest.raises(error, match=message):
        ctl.load_state_dict({**before, **change})
    assert ctl.state_dict() == before


@pytest.mark.parametrize("pattern", ["cut", "uniform"])
@pytest.mark.parametrize("value", ["0.5", False, None])
def test_setting_drop_rate_checks_as_apply_does(pattern, value):
    model = tiny_model("llama", layers=3)
    ctl = dropbp.apply(model, 0.5, pattern=pattern)
    with pytest.raises(TypeError, match="drop_rate must be a number"):
        ctl.drop_rate = value
    with pytest.raises(TypeError, match="drop_rate"):
        dropbp.apply(tiny_model("llama", layers=3), value, pattern=pattern)
    assert ctl.drop_rate == 0.5


def test_trainer_resumed_with_another_length_says_what_happens(tmp_path, caplog):
    from test_hf_integration import _trainer

    from dropbp.integrations.hf import attach

    kw = dict(save_strategy="steps", save_steps=10, output_dir=str(tmp_path / "run"))
    first = _trainer(tmp_path, **kw)
    first_ctl = attach(first, drop_rate=0.5).controller
    first.train()
    spent = (
        first_ctl.schedule.mean_drop_rate(0, 10) * 10
    )  # forwards 0-9 as the first run's 20-forward schedule had them
    resumed = _trainer(tmp_path, **{**kw, "max_steps": 40})
    callback = attach(resumed, drop_rate=0.5)
    with caplog.at_level(logging.WARNING, logger="dropbp"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-10"))
    ctl = callback.controller
    assert ctl.total_steps == 40
    said = [r.getMessage() for r in caplog.records if "another length" in r.getMessage()]
    assert len(said) == 1 and "20 forwards before, 40 now" in said[0]
    mean = (ctl.schedule.mean_drop_rate(10, 40) * 30 + spent) / 40
    assert f"mean drop rate is {mean:.3f}" in said[0]


@pytest.mark.parametrize(
    ("option", "value"), [("drop_rate", 0.75), ("pattern", "uniform"), ("max_patterns", 8), ("stratify", 2)]
)
def test_a_resumed_trainer_honours_its_callbacks_options_and_says_so(tmp_path, caplog, option, value):
    """Class A: a checkpoint saved at drop_rate=0.5 (cut, unbounded, stratify 1) does not silently replace what a
    resumed run's callback asks for: the callback's setting is used from there on, with a warning naming it."""
    from test_hf_integration import _trainer


    kw = dict(save_strategy="steps", save_steps=10, output_dir=str(tmp_path / "run"))
    first = _trainer(tmp_path, **kw)
    attach_experimental(first, drop_rate=0.5, pattern="cut")
    first.train()
    resumed = _trainer(tmp_path, **kw, gradient_accumulation_steps=2 if option == "stratify" else 1)
    asked = {"drop_rate": 0.5, "pattern": "cut", option: value}
    callback = attach_experimental(resumed, **asked)
    with caplog.at_level(logging.WARNING, logger="dropbp"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-10"))
    ctl = callback.controller
    if option == "stratify":  # a feature now: the callback's is attached and named by its key
        assert ctl.features["stratified_cuts"].config() == {"group": value}
        option, value = "stratified_cuts", {"group": value}
    else:
        assert getattr(ctl.options, option) == value
    said = [r.getMessage() for r in caplog.records if "this callback asks for" in r.getMessage()]
    assert len(said) == 1 and f"{option}={value!r}" in said[0] and "checkpoint-10" in said[0]


@pytest.mark.parametrize(
    ("saved", "resumed", "warned"),
    [
        # a CPU checkpoint with stratified cuts, resumed on the lazy device whose callback asks for none
        ({"backend": "cpu", "stratify": 2}, {"backend": "lazy"}, "stratified_cuts={'group': 2}"),
        # the checkpoint's auto warm-up fitted 0.5; the callback asks for uniform 0.8, whose fit is shorter
        ({"pattern": "cut"}, {"pattern": "uniform", "drop_rate": 0.8}, "drop_rate=0.5, pattern='cut'"),
        # the lazy device's own bound, saved and asked (max_patterns=None): nothing differs, nothing said
        ({"backend": "lazy"}, {"backend": "lazy"}, None),
    ],
)
def test_a_resumed_trainer_loads_what_its_callback_asks_for_on_its_device(tmp_path, caplog, saved, resumed, warned):
    """Class A, found by tests/test_trainer_runs.py: the checkpoint's settings are replaced by the callback's before
    they reach this device (a state the lazy device refuses loads where the callback asks for what it takes), the
    schedule is fitted again to the asked rate, and a device's own bound is not a change."""
    from test_hf_integration import _trainer


    kw = dict(save_strategy="steps", save_steps=10, output_dir=str(tmp_path / "run"), gradient_accumulation_steps=2)
    first = _trainer(tmp_path, **kw)
    attach_experimental(first, **{"drop_rate": 0.5, **saved})
    first.train()
    again = _trainer(tmp_path, **kw)
    callback = attach_experimental(again, **{"drop_rate": 0.5, **resumed})
    with caplog.at_level(logging.WARNING, logger="dropbp"):
        again.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-10"))
    ctl = callback.controller
    assert ctl.step == 40 and ctl.total_steps == 40 and "stratified_cuts" not in ctl.features
    assert ctl.schedule.mean_drop_rate(0, 40) == pytest.approx(ctl.drop_rate)
    said = [r.getMessage() for r in caplog.records if "this callback asks for" in r.getMessage()]
    assert said == [] if warned is None else (len(said) == 1 and warned in said[0])


def _saved_trainer_state(tmp_path):
    """A Trainer run under ``attach`` that saved a checkpoint at step 10; returns a function making a fresh attached
    trainer over the same output folder, and the path of that checkpoint's dropbp state file."""
    from test_hf_integration import _trainer

    from dropbp.integrations.hf import STATE_FILE, attach

    kw = dict(save_strategy="steps", save_steps=10, output_dir=str(tmp_path / "run"))

    def attached():
        trainer = _trainer(tmp_path, **kw)
        attach(trainer, drop_rate=0.5)
        return trainer

    attached().train()
    return attached, tmp_path / "run" / "checkpoint-10" / STATE_FILE


def test_a_tampered_trainer_checkpoint_is_refused_naming_the_file_and_the_field(tmp_path):
    import json

    attached, path = _saved_trainer_state(tmp_path)
    saved = json.loads(path.read_text())
    saved["controller"]["seed"] = "0"
    path.write_text(json.dumps(saved))
    with pytest.raises(TypeError, match=r"dropbp_state.json was refused: state\['seed'\]"):
        attached().train(resume_from_checkpoint=str(path.parent))
    path.write_text(json.dumps({"controller": saved["controller"]}))
    with pytest.raises(ValueError, match="is not a state dropbp wrote"):
        attached().train(resume_from_checkpoint=str(path.parent))


def test_a_truncated_trainer_state_file_is_refused_naming_the_path(tmp_path):
    attached, path = _saved_trainer_state(tmp_path)
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(path.name)] == [path.name]  # no temporary
    path.write_text(path.read_text()[:40])  # a crash mid-write, as an in-place writer would leave it
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} is not valid JSON .*delete it"):
        attached().train(resume_from_checkpoint=str(path.parent))


def test_a_file_dropbp_writes_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    from dropbp import files

    path = tmp_path / "dropbp_state.json"
    files.write_atomically(path, '{"old": 1}')
    assert path.read_text() == '{"old": 1}'

    def crash(fd):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        files.write_atomically(path, '{"new": 2}')
    assert path.read_text() == '{"old": 1}'
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the temporary file is gone too


def test_a_damaged_forecast_map_is_refused_naming_the_path(tmp_path):
    from dropbp.experimental.where_it_pays import measured_map

    path = tmp_path / "where_it_pays.json"
    path.write_text('{"conditions": "cut sh')
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} is not valid JSON .*reinstall dropbp"):
        measured_map(path)


@pytest.mark.parametrize(
    ("steps", "tokens", "rate", "error"),
    [
        (float("nan"), 1024, 0.5, TypeError),
        (True, 1024, 0.5, TypeError),
        (2.5, 1024, 0.5, TypeError),
        (100, float("inf"), 0.5, TypeError),
        (100, 1024, float("nan"), ValueError),
        (100, 1024, -1, ValueError),
        (100, 1024, 5, ValueError),
    ],
)
def test_the_forecast_refuses_what_is_not_a_run(steps, tokens, rate, error):
    """Reliability round 5 (F): NaN, bools, fractional steps, infinite token counts and rates outside [0, 1) were
    accepted (or failed with "math domain error"); each is now refused naming the argument."""
    from dropbp.experimental.where_it_pays import forecast

    with pytest.raises(error, match="optimizer_steps|tokens_per_step|drop_rate"):
        forecast(steps, tokens, rate)


def test_concurrent_writers_of_one_file_never_lose_a_write(tmp_path):
    """Reliability round 5 (E): two threads writing the same file shared one temporary name, so one returned
    success while the file held the other's text and the other hit FileNotFoundError. Every write now completes, and
    the file holds one writer's whole text."""
    import threading

    from dropbp.files import write_atomically

    path, errors = tmp_path / "state.json", []
    texts = [f"{i}" * 200_000 for i in range(8)]

    def write(text: str) -> None:
        try:
            for _ in range(5):
                write_atomically(path, text)
        except Exception as error:  # noqa: BLE001 - the test reports any failure of a writer
            errors.append(error)

    threads = [threading.Thread(target=write, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and path.read_text() in texts and not list(tmp_path.glob("*.tmp-*"))


def test_a_broken_framework_entry_point_is_refused_at_every_apply(tmp_path):
    """Reliability round 5 (E): the loader marked itself done before loading, so the first ``apply`` raised and the
    second succeeded silently without dropbp's own DeepSpeed support. Every ``apply`` now says what is broken."""
    import subprocess
    import sys

    info = tmp_path / "fake_dropbp_framework-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-dropbp-framework\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[dropbp.frameworks]\nbroken = fake_dropbp_framework_missing:framework\n")
    code = (
        "import torch, dropbp\n"
        "model = torch.nn.Sequential(torch.nn.Linear(2, 2))\n"
        "for _ in range(2):\n"
        "    try:\n"
        "        dropbp.apply(model, 0.0, branches=['0'])\n"
        "        print('applied')\n"
        "    except RuntimeError as error:\n"
        "        print('refused:', str(error).splitlines()[0][:60])\n"
    )
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300).stdout
    assert out.splitlines() == ["refused: dropbp framework integration 'broken' ('fake_dropbp_framewor"] * 2, out


def test_the_demo_without_matplotlib_says_so_before_it_measures(monkeypatch, capsys, tmp_path):
    """Reliability round 5 (F): ``dropbp demo`` without matplotlib measured for about 15 minutes, then exited 2 writing
    nothing. It now stops at once, in one line, before any model is built."""
    from dropbp import imports
    from dropbp.tools import cli, demo

    def missing(module, *args, **kwargs):
        if module == "matplotlib":
            raise imports.MissingDependency("dropbp demo needs matplotlib: pip install matplotlib")
        return imports.require(module, *args, **kwargs)

    def measured(*args, **kwargs):
        raise AssertionError("the demo measured before saying what it lacks")

    monkeypatch.setattr(cli, "require", missing)
    monkeypatch.setattr(demo, "run_demo", measured)
    assert cli.main(["demo", "--out", str(tmp_path / "d"), "--backend", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "matplotlib" in err


def test_a_deep_copy_of_a_parametrized_branch_is_clean():
    """Reliability round 5 (D): with ``torch.nn.utils.parametrize`` on a branch (``weight_norm``), the class's own
    ``__deepcopy__`` copied dropbp's hooks into the copy (EMA, teacher), which then got 4x gradients. The copy is now
    the model as it was before ``apply``: no dropbp hook, the plain model's gradients."""
    import copy

    from conftest import assert_same_grads, batch, loss_and_grads, tiny_model

    model = tiny_model("llama", layers=2)
    for layer in model.model.layers:
        torch.nn.utils.parametrizations.weight_norm(layer.mlp.down_proj)
    plain = copy.deepcopy(model)
    hooks = lambda m: sum(len(x._forward_hooks) + len(x._forward_pre_hooks) for x in m.modules())  # noqa: E731
    before = hooks(model)
    ctl = dropbp.apply(
        model, 0.5, features=[dropbp.experimental.TokenDrops(0.5)]
    )  # token drops hook the (parametrized) down projections
    clone = copy.deepcopy(model)
    assert hooks(clone) == before and ctl.model is model
    ids = batch(0)
    _, want = loss_and_grads(plain, ids)
    _, got = loss_and_grads(clone, ids)
    assert_same_grads(got, want)


def _model_init_trainer(tmp_path, callbacks=None):
    import transformers
    from conftest import with_lora
    from test_hf_integration import _args, _dataset

    return transformers.Trainer(
        model_init=lambda: with_lora(tiny_model("llama", layers=4)),
        args=_args(tmp_path),
        train_dataset=_dataset(),
        data_collator=transformers.default_data_collator,
        callbacks=callbacks,
    )


@pytest.mark.parametrize("how", ["callback", "attach"])
def test_a_model_init_trainer_drops_in_every_model_it_trains(tmp_path, how):
    """Class B: ``Trainer(model_init=...)`` makes a new model at every ``train()`` (as ``hyperparameter_search``
    does); DropBP follows it, with the same options, instead of leaving it to full backprop."""
    from dropbp.controller import controller_of
    from dropbp.integrations.hf import DropBPCallback, attach

    callback = DropBPCallback(0.5) if how == "callback" else None
    trainer = _model_init_trainer(tmp_path, callbacks=[callback] if callback else None)
    if how == "attach":
        callback = attach(trainer, drop_rate=0.5)
    for _ in range(2):
        trainer.train()
        assert controller_of(trainer.model) is callback.controller and callback.controller.step == 20
        assert sum(len(callback.controller.dropped_at(s)) for s in range(20)) > 0
    assert callback in trainer.callback_handler.callbacks


def test_a_second_train_restarts_the_schedule(tmp_path, caplog):
    """Class B: ``train()`` again on the same model is a new run from step 0: its warm-up and schedule start again
    rather than continuing past the first run's end."""
    from test_hf_integration import _trainer

    from dropbp.integrations.hf import attach

    trainer = _trainer(tmp_path)
    ctl = attach(trainer, drop_rate=0.5).controller
    trainer.train()
    first = [ctl.dropped_at(s) for s in range(20)]
    with caplog.at_level(logging.INFO, logger="dropbp"):
        trainer.train()
    assert ctl.step == 20 and [ctl.dropped_at(s) for s in range(20)] == first
    assert any("the drop schedule restarts (it had counted 20" in r.getMessage() for r in caplog.records)


def test_epochs_with_a_short_last_window_schedule_the_forwards_the_run_makes(tmp_path):
    """Class B: 15 batches an epoch at accumulation 4 make 4 optimizer steps an epoch, the last of 3 batches
    (transformers' short window): 2 epochs are 30 training forwards, not 8 x 4 = 32, and the schedule (whose mean
    over the run is the drop rate) spans exactly those."""
    import transformers
    from test_hf_integration import _args, _dataset

    from dropbp.integrations.hf import attach, training_forwards

    trainer = transformers.Trainer(
        model=tiny_model("llama", layers=4),
        args=_args(tmp_path, max_steps=-1, num_train_epochs=2, gradient_accumulation_steps=4),
        train_dataset=_dataset(30),
        data_collator=transformers.default_data_collator,
    )
    ctl = attach(trainer, drop_rate=0.5).controller
    trainer.train()
    assert trainer.state.max_steps == 8 and ctl.step == 30 and ctl.total_steps == 30
    assert ctl.schedule.mean_drop_rate(0, 30) == pytest.approx(0.5)
    assert training_forwards(8, 4, range(15)) == 30 and training_forwards(5, 4, range(15)) == 19
    assert training_forwards(8, 4, range(16)) == 32 and training_forwards(8, 4, iter([])) == 32


def _patterns_per_optimizer_step(tmp_path, epochs: int, **options) -> tuple[list[list[tuple[str, ...]]], object]:
    """Epochs of 15 batches at accumulation 4 (optimizer steps of 4, 4, 4 and 3 forwards, transformers' short last
    window): the branches each training forward dropped, grouped by the optimizer step it belongs to; and the
    controller."""
    import transformers
    from test_hf_integration import _args, _dataset


    trainer = transformers.Trainer(
        model=tiny_model("llama", layers=4),
        args=_args(tmp_path, max_steps=-1, num_train_epochs=epochs, gradient_accumulation_steps=4, seed=3),
        train_dataset=_dataset(30),
        data_collator=transformers.default_data_collator,
    )
    ctl = attach_experimental(trainer, drop_rate=0.5, warmup=0, **options).controller
    seen: list[tuple[str, ...]] = []
    trainer.model.register_forward_hook(lambda m, args, out: seen.append(ctl.last_dropped) if m.training else None)
    trainer.train()
    sizes = [4, 4, 4, 3] * epochs
    assert len(seen) == sum(sizes) == ctl.step
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [seen[a : a + n] for a, n in zip(starts, sizes, strict=True)], ctl


def test_stratified_groups_are_the_optimizer_steps_when_epochs_end_with_a_short_window(tmp_path):
    """Class B: with stratify=4 every optimizer step's cut depths take one slice each of [0, 1), so a branch whose
    rate is at most 1 - 1/m is kept in at least one of the step's m forwards - in every step, not only while the
    forward count stays a multiple of 4 (a short window of 3 is a group of its own, of 3 slices)."""
    steps, ctl = _patterns_per_optimizer_step(tmp_path, epochs=6, stratify=4)
    assert ctl.windows == (15, 4)
    names = [b.name for b in ctl.branches]
    for forwards in steps:
        m = len(forwards)
        for name, rate in zip(names, ctl.rates, strict=True):
            if rate <= 1 - 1 / m:
                assert any(name not in dropped for dropped in forwards), (name, rate, forwards)


def test_a_pattern_pool_cycles_by_optimizer_step_when_epochs_end_with_a_short_window(tmp_path):
    """Class B, the lazy devices' promise: under a pool of 16 patterns, optimizer steps of 4 forwards see at most
    16 / 4 sequences of patterns, each four consecutive patterns of the pool, whatever the epochs' short windows."""
    steps, ctl = _patterns_per_optimizer_step(tmp_path, epochs=4, max_patterns=16, pattern="cut")
    whole = {tuple(forwards) for forwards in steps if len(forwards) == 4}
    assert len(whole) <= 4, len(whole)
    assert len({dropped for forwards in steps for dropped in forwards}) <= 16


@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non-reentrant"])
def test_importance_weights_are_the_forwards_whatever_changes_before_its_backward(checkpointing):
    """Class C: with ``unbiased=True`` a kept branch's weight is ``1 / (1 - r)`` for the rate of the forward that
    drew its pattern; a setter between that forward and its backward (which a re-entrant checkpoint recomputes)
    changes the next step, not this one's gradients."""
    import copy

    from conftest import loss_and_grads

    model = tiny_model("llama", layers=4)
    if checkpointing:
        reentrant = checkpointing == "reentrant"
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    twin = copy.deepcopy(model)
    ids = batch(4, size=2, length=12)
    ctl = apply_arm(model, 0.5, unbiased=True, pattern="uniform", seed=3)
    still = apply_arm(twin, 0.5, unbiased=True, pattern="uniform", seed=3)
    loss = model(input_ids=ids, labels=ids).loss
    ctl.drop_rate = 0.25  # after the forward, before its backward
    loss.backward()
    got = {n: p.grad for n, p in model.named_parameters()}
    _, want = loss_and_grads(twin, ids)
    assert ctl.last_dropped == still.last_dropped and ctl.last_dropped
    for name, g in want.items():
        assert (g is None) == (got[name] is None), name
        if g is not None:
            assert torch.allclose(got[name], g, atol=1e-6), name


@pytest.mark.parametrize(
    ("options", "lora_attention"),
    [
        ({"pattern": "cut", "max_patterns": 5}, False),
        ({"pattern": "cut", "max_patterns": 6, "warmup_steps": 40}, False),
        ({"pattern": "cut"}, True),
    ],
    ids=["cut-pool", "cut-pool-warming", "cut-lora-attention"],
)
def test_importance_weights_follow_how_the_patterns_are_drawn(options, lora_attention):
    """Class C: with ``unbiased=True`` the mean gradient over the patterns drawn equals full backprop's: under a
    pattern pool each kept branch is weighted by its frequency over the pool's cycle (not its nominal rate), and a
    branch the keep rule always keeps (LoRA on attention only, cut patterns) is not weighted at all. One batch, no
    optimizer step; cut patterns keep every kept branch's gradient exact, so the mean over whole cycles is exact (the
    unbiasedness of the uniform shape is only approximate: a kept branch's gradient depends on those dropped above)."""
    import peft
    from conftest import loss_and_grads

    model = tiny_model("llama", layers=3)
    if lora_attention:
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        model = peft.get_peft_model(model, config)
    model.train()
    ids = batch(6, size=2, length=12)
    _, full = loss_and_grads(model, ids)
    apply_arm(model, 0.5, unbiased=True, seed=1, **options)
    steps = 240 if options.get("warmup_steps") else 60
    total = {}
    for _ in range(steps):
        _, got = loss_and_grads(model, ids)
        for name, g in got.items():
            if g is not None:
                total[name] = total.get(name, 0) + g
    # the branch modules' own parameters (the contract of unbiased=True; a branch's norm is not weighted); with LoRA
    # on attention only and patterns drawn afresh, the top attention branch the keep rule keeps in every step (the
    # others' means carry the draws' sampling noise)
    branch_params = [n for n in full if full[n] is not None and (".self_attn." in n or ".mlp." in n)]
    if lora_attention:
        branch_params = [n for n in branch_params if ".layers.2." in n]
    worst = max((total.get(n, 0) / steps - full[n]).abs().max() / full[n].abs().max() for n in branch_params)
    # exact over whole cycles; a warm-up under a pool thins whole blocks, exact only in expectation over them
    assert worst < (0.05 if options.get("warmup_steps") else 1e-4)


def test_importance_weights_are_unbiased_over_pools_keep_rules_and_checkpointing():
    """Class C, drawn beyond the listed cases: any pool size, LoRA on every linear layer or on attention only, and
    activation checkpointing off, re-entrant or not - the mean weighted gradient over whole pool cycles of cut patterns
    equals full backprop's for every branch module's parameters."""
    hypothesis = pytest.importorskip("hypothesis")
    import peft
    from conftest import loss_and_grads
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=8, deadline=None, derandomize=True)
    @given(
        pool=st.integers(2, 7),
        rate=st.sampled_from([0.25, 0.5, 0.75]),
        targets=st.sampled_from([["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]]),
        checkpointing=st.sampled_from([None, True, False]),
        seed=st.integers(0, 5),
    )
    def check(pool, rate, targets, checkpointing, seed):
        model = tiny_model("llama", layers=3)
        if checkpointing is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False)
        model = peft.get_peft_model(model, config)
        model.train()
        ids = batch(seed, size=1, length=8)
        _, full = loss_and_grads(model, ids)
        ctl = apply_arm(model, rate, unbiased=True, seed=seed, pattern="cut", max_patterns=pool)
        total: dict = {}
        for _ in range(2 * pool):  # two whole cycles
            _, got = loss_and_grads(model, ids)
            for name, g in got.items():
                if g is not None:
                    total[name] = total.get(name, 0) + g
        ctl.remove()
        for name, g in full.items():
            if g is not None:
                assert torch.allclose(total[name] / (2 * pool), g, rtol=1e-4, atol=1e-6), (name, pool, rate)

    assert hypothesis is not None
    check()


def test_every_number_a_user_gives_is_checked_before_anything_runs():
    """Class F, drawn beyond the listed cases: any value (ints, floats with NaN and infinities, bools, None, strings,
    lists) for the forecast's arguments and ``apply``'s numeric options is either valid by the options' stated range
    and taken, or refused with a TypeError or ValueError naming the argument - nothing else escapes."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from dropbp.experimental.where_it_pays import forecast

    anything = st.one_of(
        st.integers(-3, 10**7), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
        st.text(max_size=3), st.lists(st.integers(0, 20), max_size=3),
    )  # fmt: skip

    def whole(value, least):
        return type(value) is int and value >= least

    def fraction(value):
        return type(value) in (int, float) and 0 <= value < 1

    valid = {
        "drop_rate": fraction,
        "token_drop_rate": fraction,
        "max_patterns": lambda v: v is None or (whole(v, 1) and v <= 4096),
        "warmup_steps": lambda v: whole(v, 0),
        "total_steps": lambda v: v is None or whole(v, 1),
        "stratify": lambda v: whole(v, 1),
        "seq_len": lambda v: whole(v, 1),
        "windows": lambda v: v is None or (type(v) in (list, tuple) and len(v) == 2 and all(whole(x, 1) for x in v)),
    }
    model = tiny_model("llama", layers=3)

    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(name=st.sampled_from(sorted(valid)), value=anything)
    def check_option(name, value):
        try:
            if name == "token_drop_rate":  # the experimental feature's rate
                ctl = dropbp.apply(model, 0.5, features=[dropbp.experimental.TokenDrops(value)])
            else:
                ctl = apply_arm(model, **{"drop_rate": 0.5, name: value})
        except (TypeError, ValueError) as error:
            said = "rate" if name == "token_drop_rate" else name
            assert not valid[name](value) and said in str(error), (name, value, error)
            return
        ctl.remove()
        assert valid[name](value), (name, value)

    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(steps=anything, tokens=anything, rate=anything)
    def check_forecast(steps, tokens, rate):
        ok = {"optimizer_steps": whole(steps, 1), "tokens_per_step": tokens is None or whole(tokens, 1),
              "drop_rate": fraction(rate)}  # fmt: skip
        try:
            forecast(steps, tokens, rate)
        except (TypeError, ValueError) as error:
            assert any(name in str(error) and not good for name, good in ok.items()), (steps, tokens, rate, error)
            return
        assert all(ok.values()), (steps, tokens, rate)

    assert hypothesis is not None
    check_option()
    check_forecast()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("mode", "pattern"),
    [("reentrant", "uniform"), ("non-reentrant", "uniform"), ("bound", "uniform"), ("bound", "cut")],
)
def test_the_rate_set_to_zero_between_forwards_of_one_backward_keeps_their_gradients_exact(mode, pattern, seed):
    """Issue 71, class A: at rate 0 a training forward takes the branches' hooks out, but not while an earlier forward's
    checkpointed region (the user's, re-entrant or not, or the memory bound's) is still to be recomputed in the
    backward: its dropped branches must then run without autograd again. Two forwards, the rate set to 0 between them,
    one backward: exactly the reference that detaches each forward's dropped branches."""
    from conftest import assert_same_grads, lm_loss, summed_loss_and_grads

    model = tiny_model("llama", layers=3)
    reference = copy.deepcopy(model)  # no checkpointing: its detach hooks are gone by the backward
    if mode != "bound":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
    model.train()
    rate = 0.75 if mode == "bound" else 0.5
    ctl = dropbp.apply(model, rate, seed=seed, pattern=pattern, memory_bound=mode == "bound")
    forwards = 0

    def loss(m, ids):
        nonlocal forwards
        value = lm_loss(m, ids)
        if forwards == 0:
            ctl.drop_rate = 0.0  # after the first forward, before the second and the one backward
        forwards += 1
        return value

    total, grads, seen = summed_loss_and_grads(model, [batch(1), batch(2)], ctl=ctl, loss=loss)
    want_total, want, _ = summed_loss_and_grads(reference, [batch(1), batch(2)], patterns=seen)
    assert seen[0] and seen[1] == ()  # the first forward dropped, the second (rate 0) did not
    torch.testing.assert_close(total, want_total)
    assert_same_grads(grads, want, atol=1e-5)


def test_a_users_hook_added_while_the_branches_hooks_are_out_runs_after_them_as_it_would_have():
    """Issue 71, class A: at rate 0 the branches' hooks are out; a forward hook a user registers on a branch then (an
    adapter added to its output) must run after dropbp's when they are back, as it does registered while they are in:
    on a dropped branch it would otherwise run under no-grad and its adapter lose its gradient."""

    def hooked(switched_out: bool):
        torch.manual_seed(0)
        model = tiny_model("llama", layers=2)
        adapter = torch.nn.Linear(32, 32)
        ctl = dropbp.apply(model, 0.0 if switched_out else 0.5, seed=1, pattern="uniform")
        model(input_ids=batch(0), labels=batch(0)).loss.backward()  # at rate 0 this forward takes the hooks out
        branch = dict(model.named_modules())["model.layers.0.mlp"]
        branch.register_forward_hook(lambda module, args, output: output + adapter(args[0]))
        ctl.drop_rate = 0.5
        grads = []
        for step in range(6):
            adapter.zero_grad(set_to_none=True)
            model(input_ids=batch(step), labels=batch(step)).loss.backward()
            grads.append((ctl.last_dropped, adapter.weight.grad))
        return grads

    after_out, while_in = hooked(True), hooked(False)
    assert [d for d, _ in after_out] == [d for d, _ in while_in]
    assert any("model.layers.0.mlp" in d for d, _ in while_in)  # the hooked branch dropped in some step
    for (_, got), (_, want) in zip(after_out, while_in, strict=True):
        assert got is not None and torch.equal(got, want)


@pytest.mark.parametrize("case", ["token drops alone, re-entrant", "rate 0 then 0.5, non-re-entrant"])
def test_no_false_warning_for_regions_of_forwards_run_with_the_hooks_out(case, recwarn):
    """Issue 71, class A: a forward at rate 0 runs with the branches' hooks out and records no region; recomputing its
    regions later (token drops alone under re-entrant checkpointing; a rate-0 forward then a 0.5 one before the
    backward) drops nothing, as that forward did: exact, and no "region no training forward recorded" warning."""
    from conftest import assert_same_grads, lm_loss, summed_loss_and_grads

    model = tiny_model("llama", layers=3)
    reference = copy.deepcopy(model)
    reentrant = case.startswith("token")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    if reentrant:  # token drops' exactness is tests/test_token_drops.py's: here, that nothing is said falsely
        dropbp.apply(model, 0.0, seed=3, features=[dropbp.experimental.TokenDrops(0.5)])
        for step in range(2):
            model(input_ids=batch(step), labels=batch(step)).loss.backward()
        assert not [w for w in recwarn if "no training forward of the model recorded" in str(w.message)]
        return
    ctl = dropbp.apply(model, 0.0, seed=3, pattern="uniform")
    forwards = 0

    def loss(m, ids):
        nonlocal forwards
        value = lm_loss(m, ids)
        if forwards == 0:
            ctl.drop_rate = 0.5  # the second forward drops, the first (hooks out) did not
        forwards += 1
        return value

    total, grads, seen = summed_loss_and_grads(model, [batch(1), batch(2)], ctl=ctl, loss=loss)
    want_total, want, _ = summed_loss_and_grads(reference, [batch(1), batch(2)], patterns=seen)
    assert seen[0] == () and seen[1]
    torch.testing.assert_close(total, want_total)
    assert_same_grads(grads, want, atol=1e-5)
    assert not [w for w in recwarn if "no training forward of the model recorded" in str(w.message)]
