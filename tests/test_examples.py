"""The examples users copy, each run as a user runs it (a fresh process, from another folder) in its smoke mode: a tiny
random model and a few steps. On the packaged SmolLM2 they were run by hand (CHANGELOG / the closing notes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_sft_lora_trains_both_arms_and_prints_the_speedup_it_saw(tmp_path):
    pytest.importorskip("trl")
    args = ("--model", "tiny", "--max-steps", "3", "--seq-len", "32", "--out", "o")
    out = run_example("sft_lora.py", *args, cwd=tmp_path)
    assert "median step: full backprop" in out and "step speedup this run saw:" in out


@pytest.mark.parametrize("checkpointing", [True, False])
def test_long_context_runs_the_measured_recipe(tmp_path, checkpointing):
    """Checkpointing on by default (what reached the longest sequence, like for like); the bound alone on request."""
    flags = ("--model", "tiny", "--seq-len", "128", "--max-steps", "2")
    out = run_example("long_context.py", *flags, *(() if checkpointing else ("--no-checkpointing",)), cwd=tmp_path)
    assert f"activation checkpointing {'on' if checkpointing else 'off'}" in out
    assert "the memory bound on, at most 2 branches store activations" in out
    assert out.count("step ") == 2


def test_the_paper_recipe_runs_both_arms(tmp_path):
    """docs/reproduce-the-paper.md's command in its smoke mode: full backprop, then the paper's settings."""
    out = run_example("reproduce_paper.py", "--tiny", "--steps", "10", cwd=tmp_path)
    assert "full backprop:" in out and "DropBP 0.875 (uniform, rates allocated at 10%):" in out
    assert "step speedup" in out


def test_the_gaudi_recipe_runs_on_the_lazy_engine_stand_in(tmp_path):
    out = run_example(
        "gaudi.py", "--max-steps", "4", "--seq-len", "32", "--out", "o", cwd=tmp_path, env={"DROPBP_BACKEND": "lazy"}
    )
    assert "drop patterns used: at most" in out and "(bound 16)" in out


def test_the_gaudi_recipe_says_which_backends_it_runs_on(tmp_path):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "gaudi.py"), "--max-steps", "2"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "DROPBP_BACKEND": "cpu"},
    )
    assert result.returncode != 0 and "DROPBP_BACKEND=hpu (Gaudi) or DROPBP_BACKEND=lazy" in result.stderr


@pytest.mark.parametrize(
    ("name", "args", "said"),
    [
        ("finetune.py", ("--steps", "0"), "--steps: expected a positive integer, got '0'"),
        ("finetune.py", ("--seq-len", "1"), "--seq-len: expected a sequence length of at least 2 tokens"),
        ("long_context.py", ("--seq-len", "1"), "--seq-len: expected a sequence length of at least 2 tokens"),
        ("sft_lora.py", ("--drop-rate", "1.5"), "--drop-rate: expected a drop rate in [0, 1), got '1.5'"),
    ],
)
def test_the_examples_refuse_bad_input_before_they_run(tmp_path, name, args, said):
    """Reliability round 5 (F): ``--steps 0`` divided by zero at the end, ``--seq-len 1`` trained on NaN losses and
    exited 0, ``--drop-rate 1.5`` ran the whole baseline first; each is now refused as the command line is read."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert result.returncode == 2 and said in result.stderr, result.stderr[-2000:]


def test_the_sft_extra_installs_every_module_sft_lora_imports():
    """examples/sft_lora.py's third-party imports are each in the ``sft`` extra or a dependency one of them declares
    (tokenizers comes with transformers): ``pip install ".[sft]"`` is all it needs besides torch."""
    import ast
    import importlib.metadata
    import re

    import tomllib

    tree = ast.parse((EXAMPLES / "sft_lora.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    third_party = imported - set(sys.stdlib_module_names) - {"__future__", "dropbp", "torch"}
    pyproject = tomllib.loads((EXAMPLES.parent / "pyproject.toml").read_text())
    extra = {re.split(r"[<>=!~ ;\[]", r)[0].lower() for r in pyproject["project"]["optional-dependencies"]["sft"]}
    brought = {
        re.split(r"[<>=!~ ;\[(]", r)[0].lower()
        for package in extra
        for r in importlib.metadata.requires(package) or []
        if "extra ==" not in r
    }
    missing = sorted(m for m in third_party if m.lower() not in extra | brought)
    assert third_party and not missing, f"sft_lora.py imports {missing}, which the sft extra does not install"


@pytest.mark.parametrize(
    ("version", "keyword"),
    [("4.55.4", "torch_dtype"), ("4.55.0.dev0", "torch_dtype"), ("4.56.0", "dtype"), ("4.57.1", "dtype"),
     ("5.17.0", "dtype")],  # fmt: skip
)
def test_models_load_with_the_dtype_keyword_the_installed_transformers_takes(version, keyword):
    """transformers 4.55 (optimum-habana 1.20's) takes ``torch_dtype=``; ``dtype=`` from 4.56 on."""
    from dropbp.tools.pretrained import dtype_keyword

    assert dtype_keyword(version) == keyword


def test_a_model_loads_in_the_dtype_asked_for(tmp_path):
    """load_causal_lm(path, torch.bfloat16) gives bfloat16 weights with the installed transformers (what sft_lora.py
    asks for on a GPU), float32 by default."""
    import torch
    import transformers

    from dropbp.tools.pretrained import load_causal_lm

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2)  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    vocab = {f"<{i}>": i for i in range(64)}
    tokenizers = pytest.importorskip("tokenizers")
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<0>"))
    ).save_pretrained(tmp_path)
    assert next(load_causal_lm(str(tmp_path), torch.bfloat16)[0].parameters()).dtype == torch.bfloat16
    assert next(load_causal_lm(str(tmp_path))[0].parameters()).dtype == torch.float32


#: transformers 5.x's word for a name it renamed (gradient -> activation checkpointing), removed in 6.
RENAMED = "is deprecated and will be removed in v6"


def _load_example(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), EXAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_examples_and_dropbp_call_no_name_transformers_renamed(tmp_path, monkeypatch, capsys):
    """transformers 5.x renamed gradient checkpointing to activation checkpointing (the old names warn, 6 removes
    them): neither dropbp nor an example calls an old name where the installed transformers has the new one. (PEFT's
    own ``get_peft_model`` still reads ``is_gradient_checkpointing``: its call, not ours.)"""
    import traceback
    import warnings

    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    model_class = transformers.PreTrainedModel
    if not hasattr(model_class, "activation_checkpointing_enable"):
        pytest.skip(f"transformers {transformers.__version__} has only the old names")
    callers = []
    for old in ("gradient_checkpointing_enable", "gradient_checkpointing_disable"):
        original = getattr(model_class, old)

        def recorded(self, *args, _original=original, _old=old, **kwargs):
            caller = traceback.extract_stack()[-2].filename
            callers.append((_old, caller))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(model_class, old, recorded)
    mine = (str(EXAMPLES), str(EXAMPLES.parent / "dropbp"))
    monkeypatch.chdir(tmp_path)
    _load_example("long_context.py").main(["--model", "tiny", "--seq-len", "64", "--max-steps", "1"])
    assert "activation checkpointing on" in capsys.readouterr().out
    assert not [(old, caller) for old, caller in callers if caller.startswith(mine)]
    sft = _load_example("sft_lora.py")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = trl.SFTConfig(output_dir=str(tmp_path / "o"), use_cpu=True, **sft.checkpointing_arguments())
    assert config.gradient_checkpointing is True
    assert not [str(w.message) for w in caught if RENAMED in str(w.message)]
