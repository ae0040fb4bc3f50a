"""DropBP as an axolotl plugin: named in the config's ``plugins:`` list, set with ``dropbp_*`` keys.

    plugins:
      - dropbp.integrations.axolotl.DropBPPlugin
    dropbp_drop_rate: 0.5

Every key is ``dropbp_`` and an option of :class:`dropbp.options.TrainerOptions` (:data:`DropBPArgs`, generated from
them in :mod:`dropbp.integrations.config_keys`). ``add_callbacks_post_trainer`` does what
:func:`dropbp.integrations.hf.attach` does and returns the callback; ``register`` sets ``ddp_find_unused_parameters:
true`` when unset. Without axolotl installed the plugin subclasses ``object``. Why these hooks, and how it is tested
against axolotl 0.19: docs/axolotl.md.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from transformers import Trainer, TrainerCallback

from dropbp.integrations.config_keys import dropbp_args
from dropbp.integrations.hf import callback_for

try:
    from axolotl.integrations.base import BasePlugin
except ModuleNotFoundError as missing:
    if missing.name != "axolotl":  # axolotl is there but broken: say so, do not hide it
        raise
    BasePlugin = object  # type: ignore[assignment,misc]

__all__ = ["DropBPPlugin"]


def __getattr__(name: str) -> Any:
    """``DropBPArgs``, the config keys axolotl imports by name (:func:`~dropbp.integrations.config_keys.dropbp_args`:
    one key per registered feature included)."""
    if name == "DropBPArgs":
        return dropbp_args()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

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
        return [callback_for(trainer, dropbp_args().from_config(cfg).options())]
