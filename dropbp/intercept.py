"""Changing what one module instance does without touching its class: its output's items, or its ``forward``.

Forward hooks that rewrite a module's output (gradient scaling, sensitivity taps) all walk the same
shapes: a tuple of items or a single value, of which only some are tensors. :func:`map_output` walks
them once.

Patches of ``forward`` are instance attributes, as Liger-Kernel binds its replacements on a loaded
model: the class, other instances, state dict keys and ``isinstance`` are untouched. Removal puts back
exactly what the instance had (its own earlier ``forward`` attribute, or none), so patches that
stack on one module, or a remove() called twice, leave nothing behind. A patch another library has
wrapped since (Accelerate's mixed-precision forward holds the forward it found) is not unwound from
under that wrapper: it stays in the chain and passes every call straight through.
"""

from __future__ import annotations

import functools
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
    a patch need not track whether it is on. When another wrapper was set on top since ``install()``,
    ``remove()`` leaves that wrapper in place and this patch passes calls through to what it replaced.
    """

    def __init__(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        self.module = module
        self._forward = forward
        self._previous: Any = _ABSENT  # the instance's own ``forward`` before install(), if it had one
        self.installed = False
        self._covered = False  # removed while another wrapper held it: still in the chain, passing through

        def entry(*args: Any, **kwargs: Any) -> Any:
            return (self._forward if self.installed else self.original())(*args, **kwargs)

        functools.update_wrapper(entry, forward, updated=())  # signatures read through it: the Trainer's columns
        self.entry = entry  # what the instance's ``forward`` attribute holds while this patch is in the chain
        mark_patch(entry, self.replaced)  # a copy of the module gets what the patch replaced

    def replaced(self) -> Callable[..., Any] | None:
        """The instance's own ``forward`` attribute the installed patch replaced, or None."""
        return None if self._previous is _ABSENT else self._previous

    def install(self) -> ForwardPatch:
        if not self.installed:
            if not self._covered:  # still in the chain under another wrapper: active again in place
                self._previous = vars(self.module).get("forward", _ABSENT)
                self.module.forward = self.entry
            self.installed = True
        return self

    def remove(self) -> None:
        if not self.installed:
            return
        self.installed = False
        if vars(self.module).get("forward") is not self.entry:
            self._covered = True  # another wrapper holds ``entry``: it passes through from now on
            return
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
