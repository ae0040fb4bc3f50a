"""Changing what one module instance does without touching its class: its output's items, or its ``forward``.

Forward hooks that rewrite a module's output (gradient scaling, sensitivity taps) all walk the same
shapes: a tuple of items or a single value, of which only some are tensors. :func:`map_output` walks
them once.

Patches of ``forward`` are instance attributes, as Liger-Kernel binds its replacements on a loaded
model: the class, other instances, state dict keys and ``isinstance`` are untouched. Removal puts back
exactly what the instance had (its own earlier ``forward`` attribute, or none), so patches that
stack on one module, or a remove() called twice, leave nothing behind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from .copies import mark_patch

__all__ = ["ForwardPatch", "map_output"]

_ABSENT = object()


def map_output(output: object, fn: Callable[[Any], Any]) -> object:
    """``fn`` applied to each item of a module's output: a tuple stays a tuple of the same length, a single
    value stays single."""
    items = output if isinstance(output, tuple) else (output,)
    mapped = [fn(item) for item in items]
    return tuple(mapped) if isinstance(output, tuple) else mapped[0]


class ForwardPatch:
    """``module.forward`` replaced by ``forward`` on this instance while installed.

    ``install()`` (or entering the ``with`` block) sets the attribute and keeps what was there;
    ``remove()`` (or leaving the block) restores it; both do nothing when already done, so the owner of
    a patch need not track whether it is on.
    """

    def __init__(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        self.module = module
        self._forward = forward
        self._previous: Any = _ABSENT  # the instance's own ``forward`` before install(), if it had one
        self.installed = False
        mark_patch(forward, self.replaced)  # a copy of the module gets what the patch replaced

    def replaced(self) -> Callable[..., Any] | None:
        """The instance's own ``forward`` attribute the installed patch replaced, or None."""
        return None if self._previous is _ABSENT else self._previous

    def install(self) -> ForwardPatch:
        if not self.installed:
            self._previous = vars(self.module).get("forward", _ABSENT)
            self.module.forward = self._forward
            self.installed = True
        return self

    def remove(self) -> None:
        if not self.installed:
            return
        self.installed = False
        if self._previous is _ABSENT:
            vars(self.module).pop("forward", None)
        else:
            self.module.forward = self._previous
        self._previous = _ABSENT

    def original(self) -> Callable[..., Any]:
        """The forward under the patch: the instance's earlier attribute, else the class's method."""
        if self._previous is not _ABSENT:
            return self._previous
        return type(self.module).forward.__get__(self.module)

    def __enter__(self) -> ForwardPatch:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()
