"""LLaMA-Factory driven by its own YAML: ``dropbp_*`` keys beside LLaMA-Factory's, run through its ``run_exp``.

    dropbp llamafactory train.yaml        # instead of: llamafactory-cli train train.yaml

``llamafactory-cli`` hands its trainers no callbacks. :func:`run` reads the YAML (or takes its dict), takes out the
``dropbp_*`` keys (the axolotl plugin's keys, :data:`dropbp.integrations.config_keys.DropBPArgs`: every option of
``DropBPCallback``), checks them, sets ``ddp_find_unused_parameters: true`` when the file leaves it unset (under DDP
a dropped branch's parameters get no gradient), and calls ``run_exp(rest, callbacks=[DropBPCallback(...)])``.
Tested against LLaMA-Factory 0.9.5 itself by ``bash ci/llamafactory.sh`` (docs/trainer.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dropbp.imports import require
from dropbp.integrations.config_keys import PREFIX, dropbp_args, moved_key

__all__ = ["load_config", "run", "split_config", "train"]


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The YAML file at ``path`` as a dict (LLaMA-Factory's training config)."""
    yaml = require("yaml", "reading a LLaMA-Factory config")
    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds no LLaMA-Factory config: a YAML mapping of keys, got {type(config).__name__}")
    return config


def split_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """LLaMA-Factory's keys (with ``ddp_find_unused_parameters`` true unless set) and dropbp's (a
    :func:`~dropbp.integrations.config_keys.dropbp_args` model), checked: an unknown
    ``dropbp_*`` key or a bad value fails here, naming the key, before LLaMA-Factory loads anything."""
    args = dropbp_args()
    unknown = sorted(key for key in config if key.startswith(PREFIX) and key not in args.model_fields)
    for key in unknown:  # an earlier release's key says what to write now
        said = moved_key(key)
        if said is not None:
            raise ValueError(said)
    if unknown:
        raise ValueError(f"unknown dropbp keys {unknown}; dropbp's keys are: {', '.join(args.model_fields)}")
    keys = args.from_config(config)
    rest = {key: value for key, value in config.items() if not key.startswith(PREFIX)}
    if rest.get("ddp_find_unused_parameters") is None:
        rest["ddp_find_unused_parameters"] = True
    return rest, keys


def train(args: dict[str, Any], keys: Any) -> None:
    """``run_exp(args, callbacks=[DropBPCallback(...)])`` for a config :func:`split_config` split."""
    tuner = require("llamafactory.train.tuner", "dropbp llamafactory")
    from dropbp.integrations.hf import DropBPCallback

    tuner.run_exp(args, callbacks=[DropBPCallback(**keys.attach_kwargs())])


def run(config: str | os.PathLike[str] | Mapping[str, Any]) -> None:
    """Train with LLaMA-Factory's ``run_exp`` and DropBP, from a YAML file or its dict (see the module)."""
    train(*split_config(config if isinstance(config, Mapping) else load_config(config)))
