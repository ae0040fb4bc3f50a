"""``dropbp.apply``: the public entry point, which turns names and numbers into the controller's parts.

Its keyword options, their defaults, help and checks are :class:`dropbp.options.DropBPOptions`'s
(declared once there; ``help(dropbp.apply)`` lists them). The controller (:class:`~dropbp.controller.DropBPController`)
validates them, unwraps the model, resolves the backend, finds the branches (:mod:`dropbp.execution.discovery`) and
builds the drop policy (:mod:`dropbp.policy.drop_policy`, which resolves the ``"auto"``s and checks the rates against
the model's branches), each once.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dropbp.controller import DropBPController
from dropbp.options import DropBPOptions, takes_options

__all__ = ["apply"]


@takes_options(DropBPOptions)
def apply(model: nn.Module, drop_rate: float, **options: Any) -> DropBPController:
    """Attach DropBP to ``model``: each training step drops the backward of random residual branches.

    A branch is the ``f`` in a residual update ``x = x + f(x)``: the attention and the MLP of every
    layer. Recognised Hugging Face architectures (``dropbp.SUPPORTED_ARCHITECTURES``) are found by
    their child names; other models name their branch modules with ``branches=``.

    Args:
        model: a Hugging Face, PEFT or custom ``nn.Module``, possibly wrapped in
            ``DistributedDataParallel`` (which must have ``find_unused_parameters=True``): the
            branches are then found in its ``.module`` and named as there. Wrapping after ``apply``
            works the same; so does FSDP2 ``fully_shard`` before or after, and a DeepSpeed engine
            (``deepspeed.initialize`` before or after; :mod:`dropbp.integrations.deepspeed`).
        drop_rate: and every keyword below: :class:`dropbp.options.DropBPOptions`, checked when made.

    Returns:
        The :class:`DropBPController`; ``ctl.remove()`` restores the model exactly.
    """
    return DropBPController(model, drop_rate, **options)
