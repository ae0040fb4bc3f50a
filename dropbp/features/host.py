"""What a feature may use of the controller it is attached to: the model, its branches, the device and the hooks.

The controller builds one :class:`Host` and hands it to each feature's ``attach``; a feature reaches the core only
through it (no feature imports the controller).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from dropbp.backends import Backend
from dropbp.execution.discovery import Branch
from dropbp.execution.hooks import StepHooks

__all__ = ["Host"]


@dataclass(frozen=True)
class Host:
    """The controller's parts a feature uses."""

    #: The model (unwrapped from DDP or a framework's engine).
    model: nn.Module
    #: The branches, in forward order.
    branches: Sequence[Branch]
    backend: Backend
    #: The per-step decision: ``hooks.forced`` (calibration's passes), ``hooks.kept_step(index)``, ``listen``.
    hooks: StepHooks
    #: The options as given (:class:`dropbp.options.DropBPOptions`, ``"auto"``s kept as such).
    given: Callable[[], Any]
    #: The options in force (resolved on the backend; ``ctl.schedule.options``).
    in_force: Callable[[], Any]
    #: Ask the controller to resolve its options again: an ``"auto"`` the feature owns has a new value.
    resolve_again: Callable[[], None]
