"""LLaMA-Factory: the README's recipe, ``run_exp(args, callbacks=[DropBPCallback(...)])``, run against LLaMA-Factory.

LLaMA-Factory is not in CI's environment: 0.9.5 pins transformers <= 5.6, peft <= 0.18.1 and accelerate <= 1.11,
older than dropbp's ``hf`` extra asks for, so ``bash ci/llamafactory.sh`` runs this file in an environment of its
own (docs/trainer.md); here it skips. A tiny random Llama and a word-level tokenizer are saved locally, the data is
a local JSON-lines file: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import assert_framework_run, import_or_reason, save_tiny_llama, word_rows

transformers = pytest.importorskip("transformers")

llamafactory, LLAMAFACTORY_MISSING = import_or_reason(
    "llamafactory",
    "LLaMA-Factory 0.9.5 pins transformers <= 5.6 and peft <= 0.18.1, older than dropbp's hf extra asks for: "
    "bash ci/llamafactory.sh runs this file in an environment of its own",
)
pytestmark = pytest.mark.skipif(llamafactory is None, reason=LLAMAFACTORY_MISSING)

#: The recipe as the README gives it, with a tiny local model and data; run as a user runs a script.
_SCRIPT = """
from llamafactory.train.tuner import run_exp
from dropbp.integrations.hf import DropBPCallback

args = {args}
run_exp(args, callbacks=[DropBPCallback(drop_rate=0.5, pattern="uniform", warmup=0.0, calibrate_at=0.1)])
"""


def _model_and_data(tmp_path):
    model_dir = tmp_path / "model"
    save_tiny_llama(model_dir)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "words.jsonl").write_text("".join(json.dumps({"text": row}) + "\n" for row in word_rows()))
    info = {"words": {"file_name": "words.jsonl", "columns": {"prompt": "text"}}}
    (data_dir / "dataset_info.json").write_text(json.dumps(info))
    return model_dir, data_dir


def test_run_exp_with_the_callback_trains_with_dropped_branches(tmp_path):
    """LLaMA-Factory's own ``run_exp`` (pre-training stage, LoRA on every linear layer) with the callback: the run
    calibrates once at 10%, drops branches at every logging step, and each checkpoint carries DropBP's state."""
    model_dir, data_dir = _model_and_data(tmp_path)
    args = {
        "stage": "pt",
        "do_train": True,
        "model_name_or_path": str(model_dir),
        "finetuning_type": "lora",
        "lora_target": "all",
        "lora_rank": 4,
        "dataset": "words",
        "dataset_dir": str(data_dir),
        "cutoff_len": 32,
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 2,
        "max_steps": 20,
        "learning_rate": 1e-3,
        "logging_steps": 5,
        "save_steps": 20,
        "report_to": "none",
        "seed": 7,
        "use_cpu": True,
        "bf16": False,
        "overwrite_output_dir": True,
        "plot_loss": False,
    }
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT.format(args=repr(args)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env["HF_HOME"] = str(tmp_path / "hf")  # the dataset cache stays in the test's folder
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert_framework_run(run, tmp_path / "out" / "checkpoint-20")


def test_the_yaml_route_trains_from_a_config_with_dropbp_keys(tmp_path):
    """``dropbp llamafactory train.yaml``: LLaMA-Factory's own YAML with ``dropbp_*`` keys, run through its
    ``run_exp`` with the callback the keys describe (the same run as above, from a file)."""
    yaml = pytest.importorskip("yaml")
    model_dir, data_dir = _model_and_data(tmp_path)
    config = {
        "stage": "pt", "do_train": True, "model_name_or_path": str(model_dir), "finetuning_type": "lora",
        "lora_target": "all", "lora_rank": 4, "dataset": "words", "dataset_dir": str(data_dir), "cutoff_len": 32,
        "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 2, "max_steps": 20,
        "learning_rate": 1e-3, "logging_steps": 5, "save_steps": 20, "report_to": "none", "seed": 7,
        "use_cpu": True, "bf16": False, "overwrite_output_dir": True, "plot_loss": False,
        "dropbp_drop_rate": 0.5, "dropbp_pattern": "uniform", "dropbp_warmup": 0.0, "dropbp_calibrate_at": 0.1,
    }  # fmt: skip
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env["HF_HOME"] = str(tmp_path / "hf")
    command = [sys.executable, "-m", "dropbp", "llamafactory", str(path)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert_framework_run(run, tmp_path / "out" / "checkpoint-20")
