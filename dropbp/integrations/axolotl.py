"""DropBP as an axolotl plugin: named in the config's ``plugins:`` list, set with ``dropbp_*`` keys.

    plugins:
      - dropbp.integrations.axolotl.DropBPPlugin
    dropbp_drop_rate: 0.5
    dropbp_pattern: cut          # or uniform (the paper's; the only one that calibrates)
    dropbp_warmup: 0.2           # fraction of the training steps over which the rates rise from 0
    dropbp_calibrate_at: auto    # a fraction of the steps, auto, or false/null (never)
    dropbp_seed: 0               # default: the run's seed

axolotl imports this module by that dotted name, makes an instance of the class, merges
:class:`DropBPArgs` into its config model (so a bad value stops ``axolotl train`` while the config
is checked, before any model is loaded) and calls the plugin's hooks. The plugin does what
:func:`dropbp.integrations.hf.attach` does, at the hook that hands it the trainer:
``add_callbacks_post_trainer`` applies DropBP to ``trainer.model`` (the model with its LoRA
adapters, after axolotl's freezing) and returns the callback, which axolotl adds to the trainer;
``register`` sets ``ddp_find_unused_parameters: true`` when the config leaves it unset.

It does not use ``post_model_load``/``post_lora_load``: axolotl calls those for every model it loads
(the reference model of a DPO run too, and the model of ``axolotl inference``/``merge-lora``), and
``unfrozen_parameters`` freezes weights only after them, which changes what DropBP may leave
without a gradient.

Tested against axolotl 0.19.0 itself (``bash ci/axolotl.sh``: its plugin manager, its config
merging, and ``axolotl train`` on a tiny model), in an environment of its own: axolotl pins older
transformers and peft than dropbp's hf extra, so CI's environment has no axolotl and this module
imports without it (the plugin then subclasses ``object``; tests/test_axolotl.py drives it by hand).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt, model_validator
from transformers import Trainer, TrainerCallback

from ..checks import check_choice, check_fraction, check_int
from ..dropped_grads import DEFAULT_DROPPED_GRADS, DROPPED_GRADS
from .hf import build_callback, check_schedule

try:
    from axolotl.integrations.base import BasePlugin
except ModuleNotFoundError as missing:
    if missing.name != "axolotl":  # axolotl is there but broken: say so, do not hide it
        raise
    BasePlugin = object  # type: ignore[assignment,misc]

__all__ = ["DropBPArgs", "DropBPPlugin"]


def _value_error(check: Any, *args: Any, **kw: Any) -> Any:
    """``check(*args, **kw)`` with its TypeError turned into a ValueError: pydantic reports only those."""
    try:
        return check(*args, **kw)
    except TypeError as err:
        raise ValueError(str(err)) from None


class DropBPArgs(BaseModel):
    """The plugin's config keys, checked when axolotl checks the config; defaults as ``attach``'s.

    Strict types: YAML gives numbers and booleans their own types, and a lax model would read
    ``true`` as a drop rate of 1.0.
    """

    dropbp_drop_rate: StrictFloat = Field(
        default=0.5,
        description="Fraction of the residual branches' backward work dropped per step, in [0, 1).",
    )
    dropbp_pattern: str = Field(
        default="cut",
        description="'cut' (drop every branch below a random depth) or 'uniform' (the paper's patterns).",
    )
    dropbp_warmup: StrictFloat = Field(
        default=0.2, description="Fraction of the training steps over which the drop rates rise from 0."
    )
    dropbp_calibrate_at: StrictFloat | Literal["auto", False] = Field(
        default="auto",
        description=(
            "Fraction of the training steps at which the rates are calibrated (uniform patterns only); "
            "'auto': 0.1 with uniform patterns, never with cut ones; false or null: never."
        ),
    )
    dropbp_seed: StrictInt | None = Field(
        default=None, description="Seed of the drop patterns; default: the run's seed."
    )
    dropbp_branches: list[str] | None = Field(
        default=None, description="Module names of the branches, for architectures dropbp does not recognise."
    )
    dropbp_max_patterns: StrictInt | None = Field(default=None, description="Bound on distinct drop patterns.")
    dropbp_unbiased: StrictBool = Field(default=False, description="Scale kept branches' gradients by 1 / (1 - rate).")
    dropbp_dropped_grads: str = Field(
        default=DEFAULT_DROPPED_GRADS, description="What the optimizer sees for dropped parameters: skip, zero, reuse."
    )
    dropbp_chunked_loss: StrictBool | StrictInt = Field(
        default=False, description="Chunked LM head and loss: true, or tokens per chunk."
    )

    @model_validator(mode="before")
    @classmethod
    def _dropbp_null_calibrate_at_means_never(cls, data: Any) -> Any:
        """An explicit ``dropbp_calibrate_at: null`` becomes ``False``.

        axolotl drops null keys when it stores the checked config, after which a null could not be
        told apart from a key left out (which means ``auto``).
        """
        if isinstance(data, Mapping) and "dropbp_calibrate_at" in data and data["dropbp_calibrate_at"] is None:
            data = {**data, "dropbp_calibrate_at": False}
        return data

    @model_validator(mode="after")
    def _dropbp_check(self) -> DropBPArgs:
        """The checks ``attach`` and ``apply`` make, with the messages naming the config keys.

        The validators' names start with ``_dropbp`` because axolotl merges this class into its own
        config model, where a validator of the same name would replace one of axolotl's or be replaced.
        """
        try:
            check_fraction("dropbp_drop_rate", self.dropbp_drop_rate)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"{err}: it is the fraction of the residual branches' backward passes skipped per step; "
                "set it to e.g. 0.5 (the paper uses 0.5 to 0.875)"
            ) from None
        calibrate_at = None if self.dropbp_calibrate_at is False else self.dropbp_calibrate_at
        _value_error(check_schedule, self.dropbp_pattern, calibrate_at, self.dropbp_warmup, prefix="dropbp_")
        _value_error(check_choice, "dropbp_dropped_grads", self.dropbp_dropped_grads, DROPPED_GRADS)
        if self.dropbp_seed is not None:
            _value_error(check_int, "dropbp_seed", self.dropbp_seed, 0)
        if self.dropbp_max_patterns is not None:
            _value_error(check_int, "dropbp_max_patterns", self.dropbp_max_patterns, 1)
        if not isinstance(self.dropbp_chunked_loss, bool):
            name = "dropbp_chunked_loss (tokens per chunk, or true/false)"
            _value_error(check_int, name, self.dropbp_chunked_loss, 1)
        return self

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> DropBPArgs:
        """The keys of an axolotl config (a ``DictDefault``, or any mapping) that belong to DropBP."""
        return cls.model_validate({key: cfg[key] for key in cls.model_fields if key in cfg})

    def attach_kwargs(self) -> dict[str, Any]:
        """The arguments of :func:`dropbp.integrations.hf.attach` that these keys stand for."""
        return {
            "drop_rate": self.dropbp_drop_rate,
            "pattern": self.dropbp_pattern,
            "warmup": self.dropbp_warmup,
            "calibrate_at": None if self.dropbp_calibrate_at is False else self.dropbp_calibrate_at,
            "seed": self.dropbp_seed,
            "branches": self.dropbp_branches,
            "max_patterns": self.dropbp_max_patterns,
            "unbiased": self.dropbp_unbiased,
            "dropped_grads": self.dropbp_dropped_grads,
            "chunked_loss": self.dropbp_chunked_loss,
        }


class DropBPPlugin(BasePlugin):
    """The axolotl plugin: its config keys, and DropBP applied to the trainer's model with its callback."""

    def register(self, cfg: MutableMapping[str, Any]) -> None:
        """``ddp_find_unused_parameters: true`` unless the config sets it: what ``attach`` does for a Trainer.

        axolotl hands over the config before checking it. Under DDP it turns an unset
        ``ddp_find_unused_parameters`` into False, which stops DropBP at the first training forward
        (a dropped branch's parameters get no gradient); an explicit value is left alone.
        """
        if cfg.get("ddp_find_unused_parameters") is None:
            cfg["ddp_find_unused_parameters"] = True

    def get_input_args(self) -> str:
        """The dotted name of :class:`DropBPArgs`, which axolotl imports and merges into its config model."""
        return f"{__name__}.DropBPArgs"

    def add_callbacks_post_trainer(self, cfg: Mapping[str, Any], trainer: Trainer) -> list[TrainerCallback]:
        """Apply DropBP to ``trainer.model`` and return its callback, which axolotl adds to ``trainer``.

        The seed defaults to ``trainer.args.seed``, which axolotl sets from the config's ``seed``.
        """
        args = DropBPArgs.from_config(cfg)
        return [build_callback(trainer, **args.attach_kwargs())]
