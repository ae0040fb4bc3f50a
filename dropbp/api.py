"""``dropbp.apply``: the public entry point, which turns names and numbers into the controller's parts.

Its keyword options, their defaults, help and checks are :class:`dropbp.options.DropBPOptions`'s
(declared once there; ``help(dropbp.apply)`` lists them; ``dropbp.experimental.apply`` takes the experimental ones
too). It resolves the backend, finds the branches
(:mod:`dropbp.execution.discovery`), builds the drop policy (:mod:`dropbp.policy.drop_policy`, which checks the rates
against the model's branches) and hands them to :class:`~dropbp.controller.DropBPController`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from dropbp.backends import get as get_backend
from dropbp.controller import DropBPController
from dropbp.execution.discovery import find_branches
from dropbp.execution.frameworks import unwrap
from dropbp.options import DropBPOptions, takes_options
from dropbp.policy.drop_policy import DropPolicy

__all__ = ["apply", "apply_options"]


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
    return apply_options(model, DropBPOptions.given("apply", drop_rate=drop_rate, **options))


def apply_options(model: nn.Module, options: DropBPOptions) -> DropBPController:
    """:func:`apply` with its options as one (already valid) :class:`DropBPOptions`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    inner, _ = unwrap(model)
    _check_trainable(inner)
    backend = options.backend
    if backend is None or isinstance(backend, str):
        backend = get_backend(backend)
    branches = None if options.branches is None else list(options.branches)
    found = find_branches(inner, branches, options.seq_len)
    given = dataclasses.replace(options, backend=backend)
    policy = DropPolicy([b.flops for b in found], given.resolved(backend, [b.flops for b in found]))
    return DropBPController(model, found, policy, backend, given)


def _check_trainable(model: nn.Module) -> None:
    """Refuse a model with nothing to train: DropBP drops parts of a backward, and there would be none.

    Without this, ``apply`` would succeed and every ``loss.backward()`` would raise torch's bare "element 0 of
    tensors does not require grad" (and :meth:`DropBPController.backward` return False), saying nothing of why.
    """
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"dropbp.apply: no parameter of this {type(model).__name__} requires a gradient, so there is no backward "
            "pass to drop: unfreeze some (e.g. model.requires_grad_(True)) or add LoRA adapters "
            "(peft.get_peft_model) before dropbp.apply"
        )
