"""Changing what one module instance does without touching its class, and keeping copies of it clean.

Forward hooks that rewrite a module's output (gradient scaling, sensitivity taps) all walk the same shapes: a tuple of
items or a single value, of which only some are tensors. :func:`map_output` walks them once.

Patches of ``forward`` (:class:`ForwardPatch`) are instance attributes, as Liger-Kernel binds its replacements on a
loaded model: the class, other instances, state dict keys and ``isinstance`` are untouched. Removal puts back exactly
what the instance had (its own earlier ``forward`` attribute, or none), so patches that stack on one module, or a
remove() called twice, leave nothing behind. A patch another library has wrapped since (Accelerate's mixed-precision
forward holds the forward it found) is not unwound from under that wrapper: it stays in the chain and passes every
call straight through.

Copies and pickles of a model under DropBP are clean (:class:`CleanCopies`): the model as it was before ``apply``.
``copy.deepcopy`` (EMA and teacher models, TRL's reference model) and ``pickle`` / ``torch.save`` copy each module's
hook dictionaries and instance attributes. A copy carrying dropbp's hooks would obey the original's controller (its
last pattern, forever), which nothing could remove, and a pickle fails on the hooks' local functions. So every module
dropbp hooks or patches gets an instance ``__getstate__`` (which both deep copies and pickles call) returning its state
without dropbp's hook entries, without the ``forward`` dropbp put on the instance (the one it replaced instead, if
any), and without itself. The copy is an ordinary model: ``dropbp.apply`` attaches to it independently; the original
keeps its controller. :meth:`CleanCopies.remove` takes the ``__getstate__`` attributes away again.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ['CleanCopies', 'ForwardPatch', 'map_output', 'mark_patch']


_PREVIOUS = "_dropbp_previous"
_GETSTATE = "__getstate__"
_DEEPCOPY = "__deepcopy__"


def mark_patch(forward: Callable[..., Any], previous: Callable[[], Callable[..., Any] | None]) -> None:
    """Mark ``forward``, which dropbp sets as a module instance's ``forward``: a copy gets ``previous()``
    (the instance ``forward`` it replaced) instead, or no instance ``forward`` when that is None."""
    setattr(forward, _PREVIOUS, previous)


def _over_dropbp(forward: Any) -> Any:
    """``forward``, or, when it is another library's wrapper around a forward dropbp set (Accelerate's
    mixed-precision forward, put on after ``apply``), that forward of dropbp's: the wrapper calls the original
    model's forward, so a copy cannot keep it (said with a warning)."""
    if hasattr(forward, _PREVIOUS):
        return forward  # dropbp's own, on top (a feature's patch over the hooks' guard)
    link, depth = getattr(forward, "__wrapped__", None), 0
    while link is not None and depth < 16:
        if hasattr(link, _PREVIOUS):
            warnings.warn(
                f"dropbp: this copy of the model leaves out the forward another library wrapped around dropbp's "
                f"({getattr(forward, '__qualname__', type(forward).__name__)}, e.g. Accelerate's mixed precision), "
                "since that wrapper calls the original model; the copy runs its class's own forward. Wrap the copy "
                "again if it needs it (accelerator.prepare).",
                stacklevel=4,
            )
            return link
        link, depth = getattr(link, "__wrapped__", None), depth + 1
    return forward


def _entries(handles: Iterable[RemovableHandle]) -> set[tuple[int, int]]:
    """(id of a hook dictionary, hook id) for each dictionary a handle's hook is in."""
    found = set()
    for handle in handles:
        for ref in (handle.hooks_dict_ref, *handle.extra_dict_ref):
            hooks = ref()
            if hooks is not None:
                found.add((id(hooks), handle.id))
    return found


class CleanCopies:
    """Makes copies and pickles of ``modules`` leave out the hooks in ``handles()`` and dropbp's ``forward``.

    Args:
        modules: every module dropbp hooks or patches (the model, branch parts, a patched LM).
        handles: read at each copy: the handles of every hook dropbp has on them now.
    """

    def __init__(self, modules: Iterable[nn.Module], handles: Callable[[], Iterable[RemovableHandle]]) -> None:
        self._handles = handles
        self._modules = list({id(m): m for m in modules}.values())
        #: Per module, an instance ``__getstate__`` that was there before (another library's), or None.
        self._previous = [vars(m).get(_GETSTATE) for m in self._modules]
        for module, previous in zip(self._modules, self._previous, strict=True):
            module.__dict__[_GETSTATE] = self._getstate_for(module, previous)
            if _DEEPCOPY in vars(type(module)):  # e.g. torch.nn.utils.parametrize's classes: they skip __getstate__
                module.__dict__[_DEEPCOPY] = self._deepcopy_for(module, previous)

    def _getstate_for(self, module: nn.Module, previous: Callable[[], dict] | None) -> Callable[[], dict[str, Any]]:
        def getstate() -> dict[str, Any]:
            return self.clean_state(module, previous)

        return getstate

    def _deepcopy_for(self, module: nn.Module, previous: Callable[[], dict] | None) -> Callable[[dict], nn.Module]:
        """An instance ``__deepcopy__`` for a class that has its own (which copies ``__dict__`` as it is, dropbp's
        hooks included): the class's way, from the clean state."""

        def deepcopy(memo: dict) -> nn.Module:
            if id(module) in memo:
                return memo[id(module)]
            replica = module.__new__(type(module))
            memo[id(module)] = replica
            replica.__dict__ = copy.deepcopy(self.clean_state(module, previous, dict(vars(module))), memo)
            return replica

        return deepcopy

    def clean_state(
        self, module: nn.Module, previous: Callable[[], dict] | None = None, state: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """``module``'s state as it would be copied without dropbp (``state``: what the class's own copy takes, by
        default its ``__getstate__``), less everything dropbp added."""
        if state is None:
            state = dict(type(module).__getstate__(module) if previous is None else previous())
        state.pop(_GETSTATE, None)
        state.pop(_DEEPCOPY, None)
        if previous is not None:
            state[_GETSTATE] = previous
        ours = _entries(self._handles())
        for key, value in state.items():
            if isinstance(value, dict) and any((id(value), k) in ours for k in value):
                state[key] = type(value)((k, v) for k, v in value.items() if (id(value), k) not in ours)
        forward = _over_dropbp(state.get("forward"))
        while hasattr(forward, _PREVIOUS):
            forward = getattr(forward, _PREVIOUS)()
        if forward is None:
            state.pop("forward", None)
        else:
            state["forward"] = forward
        return state

    def remove(self) -> None:
        """Copies are the class's own again (call once dropbp's hooks and patches are gone)."""
        for module, previous in zip(self._modules, self._previous, strict=True):
            module.__dict__.pop(_DEEPCOPY, None)
            if previous is None:
                module.__dict__.pop(_GETSTATE, None)
            else:
                module.__dict__[_GETSTATE] = previous
        self._modules, self._previous = [], []


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


class HookSwitch:
    """Takes hooks out of their modules (``off``) and puts each back where it was (``on``): a module with no hook
    left is called on torch's fast path, with no hook call at all.

    Args:
        handles: the hooks switched, as :class:`~torch.utils.hooks.RemovableHandle` (their dicts' keys).
    """

    def __init__(self, handles: Iterable[RemovableHandle]) -> None:
        self._handles = list(handles)
        #: While off: per hooks dict, the dict, its keys' order when first taken from, and the hooks taken out.
        self._taken: dict[int, tuple[dict, list[int], dict[int, Any]]] | None = None

    @property
    def off(self) -> bool:
        return self._taken is not None

    def turn_off(self) -> None:
        if self._taken is not None:
            return
        taken: dict[int, tuple[dict, list[int], dict[int, Any]]] = {}
        for handle in self._handles:
            hooks = handle.hooks_dict_ref()
            if hooks is not None and handle.id in hooks:
                entry = taken.setdefault(id(hooks), (hooks, list(hooks), {}))
                entry[2][handle.id] = hooks.pop(handle.id)
        self._taken = taken

    def turn_on(self) -> None:
        """Each hook back in its place among its dict's others (hooks added meanwhile keep theirs: before the
        earlier ones where prepended, else after them; where none of the earlier ones is left to tell, after them, as
        hooks are registered by default: a user's hook added while ours were out runs after ours, as it would have)."""
        if self._taken is None:
            return
        for hooks, order, ours in self._taken.values():
            now = list(hooks)
            earlier = set(order)
            first = next((i for i, key in enumerate(now) if key in earlier), 0)
            merged = now[:first] + [k for k in order if k in ours or k in hooks]
            merged += [k for k in now[first:] if k not in earlier]
            values = {**hooks, **ours}
            hooks.clear()
            hooks.update((key, values[key]) for key in merged)
        self._taken = None
