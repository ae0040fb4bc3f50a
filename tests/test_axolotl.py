"""dropbp.integrations.axolotl: the config keys, and the plugin driven as axolotl drives it.

Without axolotl (it is not in CI: docs/axolotl.md) the plugin is loaded the way axolotl's
``load_plugin`` does it (import the module by its dotted name, make an instance), its config keys are
checked, stored and read back the way axolotl's ``validate_config`` does (``model_dump`` without the
null keys), and its callback goes to a real ``transformers.Trainer`` the way axolotl's trainer
builder adds it. The tests marked ``needs_axolotl`` go through axolotl's own plugin manager and
config merging, and skip when axolotl is not importable.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import assert_framework_run, import_or_reason, save_tiny_llama, tiny_model, with_lora, word_rows

transformers = pytest.importorskip("transformers")
pydantic = pytest.importorskip("pydantic")
from test_hf_integration import _args, _dataset, _trainer  # noqa: E402

import dropbp  # noqa: E402
from dropbp.integrations.axolotl import DropBPArgs, DropBPPlugin  # noqa: E402
from dropbp.integrations.hf import DropBPCallback, attach  # noqa: E402

PLUGIN = "dropbp.integrations.axolotl.DropBPPlugin"

axolotl_base, AXOLOTL_MISSING = import_or_reason(
    "axolotl.integrations.base",
    "axolotl is not in CI's environment because axolotl 0.19.0 pins transformers 5.16.1 and peft 0.20.0, older "
    "than dropbp's hf extra asks for: bash ci/axolotl.sh runs these tests in an environment of their own "
    "(docs/axolotl.md)",
)
needs_axolotl = pytest.mark.skipif(axolotl_base is None, reason=AXOLOTL_MISSING)


def _load_plugin(name: str = PLUGIN):
    """What axolotl's ``load_plugin`` does with a ``plugins:`` entry: module path, then class name."""
    module_name, class_name = name.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), class_name)()


def _stored_config(raw: dict) -> dict:
    """The config as axolotl keeps it after checking: the args model's dump, null keys left out."""
    plugin = _load_plugin()
    module_name, class_name = plugin.get_input_args().rsplit(".", 1)
    args_model = getattr(importlib.import_module(module_name), class_name)
    return {"seed": 7, **args_model.model_validate(raw).model_dump(exclude_none=True)}


def test_config_keys_default_to_attach_defaults():
    """A config that only names the plugin runs DropBP exactly as ``attach(trainer)`` would."""
    defaults = {k: p.default for k, p in inspect.signature(attach).parameters.items() if k != "trainer"}
    assert DropBPArgs().attach_kwargs() == defaults


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"dropbp_drop_rate": 1.5}, r"dropbp_drop_rate must be in \[0, 1\), got 1.5: .*set it to e.g. 0.5"),
        ({"dropbp_drop_rate": 50}, r"dropbp_drop_rate must be in \[0, 1\), got 50"),
        ({"dropbp_drop_rate": True}, r"dropbp_drop_rate.*\n.*valid number"),  # not read as 1.0
        ({"dropbp_drop_rate": "half"}, r"dropbp_drop_rate.*\n.*'auto'"),
        ({"dropbp_pattern": "random"}, r"dropbp_pattern must be one of \('cut', 'uniform'.*\), got 'random'"),
        ({"dropbp_calibrate_at": 0.1}, r"dropbp_calibrate_at=0.1 needs dropbp_pattern='uniform'"),
        ({"dropbp_warmup": 1.5}, r"dropbp_warmup must be a fraction of the training steps \(or .auto.\) in .*got 1.5"),
        ({"dropbp_dropped_grads": "zero"}, r"dropbp_dropped_grads: measured and not better, it is the feature "
         r"DroppedGradFill since dropbp 0.4: write dropbp_dropped_grad_fill: true, or a mapping .*\(mode\)"),
        ({"dropbp_stratify": 4}, r"dropbp_stratify: .*write dropbp_stratified_cuts: true, or .*\(group\)"),
        ({"dropbp_seq_len": 64}, r"dropbp_seq_len is no config key since dropbp 0.4: .*flops_at_length"),
        ({"dropbp_seed": -1}, r"dropbp_seed must be an int >= 0, got -1"),
        ({"dropbp_max_patterns": 0}, r"dropbp_max_patterns must be an int >= 1, got 0"),
        ({"dropbp_chunked_loss": 0}, r"dropbp_chunked_loss: chunk_tokens must be a positive int \(tokens per chunk\)"),
    ],
)
def test_bad_config_values_are_refused_by_key(raw, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        DropBPArgs.model_validate(raw)


def test_calibrate_at_null_or_false_means_never_even_after_axolotl_drops_null_keys():
    for never in (None, False):
        stored = _stored_config({"dropbp_pattern": "uniform", "dropbp_calibrate_at": never})
        assert DropBPArgs.from_config(stored).attach_kwargs()["calibrate_at"] is None
    left_out = _stored_config({"dropbp_pattern": "uniform"})
    assert DropBPArgs.from_config(left_out).attach_kwargs()["calibrate_at"] == "auto"


def test_plugin_from_config_trains_with_dropped_branches(tmp_path):
    """Loaded by its ``plugins:`` name, the plugin's callback goes to the trainer once (axolotl adds
    what ``add_callbacks_post_trainer`` returns); 20 steps each draw a pattern, the calibration
    happens once at 10%, and the drop figures reach the trainer's log."""
    plugin = _load_plugin()
    cfg = _stored_config({"dropbp_drop_rate": 0.5, "dropbp_pattern": "uniform", "dropbp_warmup": 0.0})
    trainer = _trainer(tmp_path, seed=cfg["seed"])
    callbacks = plugin.add_callbacks_post_trainer(cfg, trainer)
    for callback in callbacks:  # axolotl's HFCausalTrainerBuilder.build
        trainer.add_callback(callback)
    ours = [c for c in trainer.callback_handler.callbacks if isinstance(c, DropBPCallback)]
    assert len(callbacks) == 1 and ours == callbacks
    ctl = ours[0].controller
    assert ctl.seed == 7 and ctl.pattern == "uniform" and trainer.args.ddp_find_unused_parameters is True
    trainer.train()
    assert ctl.step == 20 and ours[0].calibrated
    drops = [h for h in trainer.state.log_history if "dropbp/dropped_branches" in h]
    assert len(drops) == 4 and all(0 < h["dropbp/dropped_branches"] < 8 for h in drops)


def test_plugin_settings_reach_the_controller(tmp_path):
    plugin = _load_plugin()
    raw = {"dropbp_drop_rate": 0.25, "dropbp_seed": 3, "dropbp_warmup": 0.5, "dropbp_noise_scale": True}
    trainer = _trainer(tmp_path, max_steps=4)
    (callback,) = plugin.add_callbacks_post_trainer(_stored_config(raw), trainer)
    ctl = callback.controller
    assert (ctl.drop_rate, ctl.seed, ctl.pattern, callback.warmup, callback.calibrate_at) == (0.25, 3, "cut", 0.5, None)
    assert isinstance(ctl.features["noise_scale"], dropbp.NoiseScale)  # a feature's key builds the feature


def test_register_lets_ddp_leave_dropped_parameters_without_a_gradient_unless_the_config_says():
    """axolotl turns an unset ``ddp_find_unused_parameters`` into False under DDP; ``register`` sees
    the config first."""
    cfg = {"plugins": [PLUGIN]}
    _load_plugin().register(cfg)
    assert cfg["ddp_find_unused_parameters"] is True
    chosen = {"plugins": [PLUGIN], "ddp_find_unused_parameters": False}
    _load_plugin().register(chosen)
    assert chosen["ddp_find_unused_parameters"] is False


def test_a_model_too_shallow_for_the_rate_fails_when_the_trainer_is_built(tmp_path):
    """The per-model limit needs the model, so it is checked at the trainer hook, with the largest
    rate that fits."""
    trainer = transformers.Trainer(
        model=with_lora(tiny_model("llama", layers=1)), args=_args(tmp_path), train_dataset=_dataset()
    )
    cfg = _stored_config({"dropbp_drop_rate": 0.75, "dropbp_pattern": "uniform", "dropbp_calibrate_at": None})
    with pytest.raises(ValueError, match="with 2 branches drop_rate must be at most 0.5"):
        _load_plugin().add_callbacks_post_trainer(cfg, trainer)


@needs_axolotl
def test_axolotl_plugin_manager_loads_the_plugin_and_merges_its_keys():
    from axolotl.integrations.config import merge_input_args

    manager = axolotl_base.PluginManager.get_instance()
    manager.register(PLUGIN)
    try:
        plugin = manager.plugins[PLUGIN]
        assert isinstance(plugin, axolotl_base.BasePlugin) and isinstance(plugin, DropBPPlugin)
        _, input_config = merge_input_args()
        assert issubclass(input_config, DropBPArgs)
        assert "dropbp_drop_rate" in input_config.model_fields
    finally:
        manager.plugins.pop(PLUGIN, None)


@needs_axolotl
def test_axolotl_calls_every_hook_and_only_the_trainer_hook_applies(tmp_path):
    """Every hook of axolotl's ``BasePlugin``, through its ``PluginManager``, in the order of
    ``ModelLoader.load`` and the trainer builder; the model is untouched until the trainer exists."""
    from axolotl.utils.dict import DictDefault

    manager = axolotl_base.PluginManager.get_instance()
    manager.register(PLUGIN)
    try:
        cfg = DictDefault(_stored_config({"dropbp_drop_rate": 0.5}))
        for plugin in manager.plugins.values():  # axolotl's prepare_plugins, before checking the config
            plugin.register(cfg)
        assert cfg.ddp_find_unused_parameters is True
        model = tiny_model("llama", layers=4)
        manager.pre_model_load(cfg)
        manager.post_model_build(cfg, model)
        manager.pre_lora_load(cfg, model)
        model = with_lora(model)
        manager.post_lora_load(cfg, model)
        manager.post_model_load(cfg, model)
        assert manager.add_callbacks_pre_trainer(cfg, model) == []
        dropbp.apply(model, 0.5).remove()  # would refuse a model that already carries DropBP
        trainer = transformers.Trainer(model=model, args=_args(tmp_path, max_steps=5), train_dataset=_dataset())
        callbacks = manager.add_callbacks_post_trainer(cfg, trainer)
        for callback in callbacks:
            trainer.add_callback(callback)
        manager.post_trainer_create(cfg, trainer)
        trainer.train()
        manager.post_train(cfg, model)
        assert len(callbacks) == 1 and callbacks[0].controller.step == 5
    finally:
        manager.plugins.pop(PLUGIN, None)


_TRAIN_CONFIG = """
base_model: {model}
tokenizer_type: PreTrainedTokenizerFast
datasets:
  - path: {data}
    ds_type: json
    type: completion
dataset_prepared_path: {tmp}/prepared
output_dir: {tmp}/out
sequence_len: 32
adapter: lora
lora_r: 4
lora_alpha: 8
lora_target_linear: true
lora_mlp_kernel: false  # axolotl's fused LoRA kernels need CUDA; turned off for this CPU run
lora_qkv_kernel: false
lora_o_kernel: false
micro_batch_size: 2
max_steps: 20
num_epochs: 1
learning_rate: 0.001
optimizer: adamw_torch
lr_scheduler: constant
logging_steps: 5
save_strategy: steps
save_steps: 20
bf16: false
fp16: false
tf32: false
seed: 7
val_set_size: 0
plugins:
  - dropbp.integrations.axolotl.DropBPPlugin
dropbp_drop_rate: 0.5
dropbp_pattern: uniform
dropbp_warmup: 0.0
dropbp_calibrate_at: 0.1
"""


@needs_axolotl
def test_axolotl_train_runs_the_plugin_from_a_yaml_config(tmp_path):
    """``axolotl train config.yml`` (its own process, as a user runs it) with a tiny random llama
    saved locally: the plugin is loaded from ``plugins:``, the run calibrates once and drops branches,
    and the checkpoint carries DropBP's state."""
    model_dir = tmp_path / "model"
    save_tiny_llama(model_dir)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": row}) + "\n" for row in word_rows()))
    config = tmp_path / "config.yml"
    config.write_text(_TRAIN_CONFIG.format(model=model_dir, data=data, tmp=tmp_path))
    env = {**os.environ, "AXOLOTL_DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env["HF_HOME"] = str(tmp_path / "hf")  # the dataset cache stays in the test's folder
    run = subprocess.run(
        [sys.executable, "-m", "axolotl.cli.train", str(config)], env=env, capture_output=True, text=True, timeout=600
    )
    assert_framework_run(run, tmp_path / "out" / "checkpoint-20")


def test_drop_rate_auto_is_a_config_value():
    assert DropBPArgs.model_validate({"dropbp_drop_rate": "auto"}).attach_kwargs()["drop_rate"] == "auto"


def test_token_drops_auto_is_a_config_value():
    args = DropBPArgs.model_validate({"dropbp_token_drops": {"rate": "auto", "selection": "random"}})
    (drops,) = args.options().features
    assert (drops.key, drops.rate, drops.selection) == ("token_drops", "auto", "random")
    assert DropBPArgs.model_validate({"dropbp_token_drops": 0.0}).options().features == ()
    assert DropBPArgs.model_validate({"dropbp_token_drops": "auto"}).options().features[0].rate == "auto"
    with pytest.raises(pydantic.ValidationError, match=r"dropbp_token_drops: .*rate must be .*'auto'"):
        DropBPArgs.model_validate({"dropbp_token_drops": "most"})


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ({"dropbp_measure_noise_scale": True}, "dropbp_noise_scale: true"),
        ({"dropbp_token_drop_rate": 0.3}, "dropbp_token_drops: 0.3"),
        ({"dropbp_token_selection": "random"}, "dropbp_token_drops: {rate: 0.3, selection: random}"),
    ],
)
def test_a_0_3_feature_key_is_refused_naming_the_0_4_key(old, new):
    with pytest.raises(pydantic.ValidationError, match=f"one key per feature since dropbp 0.4: write {re.escape(new)}"):
        DropBPArgs.model_validate(old)
