"""``dropbp llamafactory CONFIG``: LLaMA-Factory's YAML with ``dropbp_*`` keys, run through ``run_exp`` with the
callback. Here against a stand-in of ``llamafactory.train.tuner.run_exp`` that records what it is given (the real
LLaMA-Factory: tests/test_llamafactory.py, in ci/llamafactory.sh's environment)."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest

pytest.importorskip("transformers")
pytest.importorskip("pydantic")

from dropbp import imports  # noqa: E402
from dropbp.integrations.hf import DropBPCallback  # noqa: E402
from dropbp.integrations.llamafactory import split_config  # noqa: E402
from dropbp.tools.cli import main  # noqa: E402

CONFIG = """\
stage: sft
do_train: true
model_name_or_path: some/model
finetuning_type: lora
output_dir: out
dropbp_drop_rate: 0.5
dropbp_token_drops: 0.3
dropbp_calibrate_at: null
"""


@pytest.fixture
def run_exp(monkeypatch):
    """A stand-in ``llamafactory.train.tuner`` whose ``run_exp(args, callbacks)`` records its arguments."""
    calls = []
    modules = {}
    for name in ("llamafactory", "llamafactory.train", "llamafactory.train.tuner"):
        modules[name] = types.ModuleType(name)
        modules[name].__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, modules[name])
    modules["llamafactory.train.tuner"].run_exp = lambda args=None, callbacks=None: calls.append((args, callbacks))
    imports.is_available.cache_clear()
    yield calls
    imports.is_available.cache_clear()


def test_the_yamls_dropbp_keys_become_the_callback_and_the_rest_goes_to_run_exp(run_exp, tmp_path, capsys):
    config = tmp_path / "train.yaml"
    config.write_text(CONFIG)
    assert main(["llamafactory", str(config)]) == 0
    [(args, callbacks)] = run_exp
    assert args == {"stage": "sft", "do_train": True, "model_name_or_path": "some/model", "finetuning_type": "lora",
                    "output_dir": "out", "ddp_find_unused_parameters": True}  # fmt: skip
    [callback] = callbacks
    assert isinstance(callback, DropBPCallback)
    options = callback.options
    (drops,) = options.features  # dropbp_token_drops builds the experimental feature
    assert (options.drop_rate, drops.rate, options.calibrate_at) == (0.5, 0.3, None)


def test_an_explicit_ddp_find_unused_parameters_is_left_as_the_file_sets_it(run_exp, tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text(CONFIG + "ddp_find_unused_parameters: false\n")
    assert main(["llamafactory", str(config)]) == 0
    assert run_exp[0][0]["ddp_find_unused_parameters"] is False


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("dropbp_drop_rat: 0.5", "unknown dropbp keys ['dropbp_drop_rat']; dropbp's keys are: dropbp_drop_rate"),
        ("dropbp_pattern: zigzag", "dropbp_pattern"),
        ("dropbp_warmup: true", "dropbp_warmup"),
    ],
)
def test_a_bad_dropbp_key_fails_before_llamafactory_runs_naming_the_key(run_exp, tmp_path, capsys, line, said):
    config = tmp_path / "train.yaml"
    config.write_text(CONFIG + line + "\n")
    assert main(["llamafactory", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dropbp: {config}: ") and said in err
    assert run_exp == []


def test_a_config_that_is_not_a_mapping_or_not_there_is_refused(run_exp, tmp_path, capsys):
    config = tmp_path / "train.yaml"
    config.write_text("- a list\n")
    assert main(["llamafactory", str(config)]) == 2
    assert "holds no LLaMA-Factory config: a YAML mapping of keys, got list" in capsys.readouterr().err
    assert main(["llamafactory", str(tmp_path / "missing.yaml")]) == 2
    assert f"no LLaMA-Factory config at {tmp_path / 'missing.yaml'}" in capsys.readouterr().err


def test_without_llamafactory_the_command_says_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(imports, "is_available", lambda module: module != "llamafactory")
    config = tmp_path / "train.yaml"
    config.write_text(CONFIG)
    assert main(["llamafactory", str(config)]) == 2
    assert "dropbp llamafactory needs llamafactory, which is not installed: pip install llamafactory==0.9.5" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("key", "said"),
    [
        ("dropbp_stratify", "dropbp_stratified_cuts"),
        ("dropbp_unbiased", "dropbp_importance_weights"),
        ("dropbp_token_drop_rate", "dropbp_token_drops"),
        ("dropbp_seq_len", "flops_at_length"),
    ],
)
def test_an_earlier_releases_key_is_refused_naming_the_key_now(key, said):
    """Issue 71, class E: LLaMA-Factory's YAML refuses 0.3's keys saying the way now, as axolotl's path does (not as
    unknown keys)."""
    with pytest.raises(ValueError, match=rf"{key}.*{said}") as refused:
        split_config({"stage": "sft", key: 1})
    assert "unknown dropbp keys" not in str(refused.value)
