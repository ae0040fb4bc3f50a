"""Exact saved-activation accounting: the bytes autograd keeps for backward after one training forward.

:func:`saved_bytes` counts, through a ``saved_tensors_hooks`` pack hook, the storages that the graph leading to the
loss still holds after a forward with a given pattern: each storage once, the model's parameters and buffers left
out, split into each branch's own (saved only within that branch) and the rest (embeddings, norms, the residual
stream, rotary tables, logits and loss, storages several branches share). :func:`branch_bytes` gives what dropping
each branch alone frees. The count depends only on the model, the batch's shape and the pattern, so it is exact and
repeatable on any device. A ``"cut"`` controller drops nothing in some steps (full backprop's memory); measure with
``pattern="uniform"`` for a figure every step shares. Why and what was measured: docs/memory.md, section 1.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from dropbp.controller import DropBPController, controller_of

__all__ = ["SavedBytes", "branch_bytes", "saved_bytes"]

Batch = torch.Tensor | Mapping[str, object] | Callable[[], torch.Tensor]


@dataclass(frozen=True)
class SavedBytes:
    """Bytes autograd holds for backward after one training forward under a fixed pattern.

    Attributes:
        total: every storage held for backward, each once (parameters and buffers excluded).
        branches: per branch (branch order), the bytes of storages saved only inside that branch's
            module; 0 for a dropped branch.
        dropped: names of the branches the pattern dropped.
        dropped_packs: tensors autograd saved inside dropped branches during the forward (0: a dropped
            branch records nothing, which is what running it under ``no_grad`` promises).
        full_total: ``total`` of the same forward with nothing dropped (None if not measured).
    """

    total: int
    branches: tuple[int, ...]
    dropped: tuple[str, ...]
    dropped_packs: int
    full_total: int | None = None

    @property
    def kept(self) -> int:
        """Bytes saved inside the kept branches."""
        return sum(self.branches)

    @property
    def rest(self) -> int:
        """Bytes saved outside every branch, or shared by several: embeddings, norms, residual, logits, loss."""
        return self.total - self.kept

    @property
    def saved_by_dropping(self) -> int | None:
        """``full_total - total``: what the dropped branches and the ops that fed only them would have kept."""
        return None if self.full_total is None else self.full_total - self.total


class _Packed:
    """What the pack hook hands autograd: the saved tensor and where it was saved. Weakly referenced, so
    that after the forward the live ones are exactly those the graph still holds."""

    __slots__ = ("tensor", "scope", "__weakref__")

    def __init__(self, tensor: torch.Tensor, scope: int | None) -> None:
        self.tensor = tensor
        self.scope = scope


def _storage_key(t: torch.Tensor) -> tuple[object, int, int] | None:
    """(device, address, bytes) of the storage under ``t``; None for tensors without one (e.g. sparse)."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return (str(t.device), storage.data_ptr(), storage.nbytes())


class _Recorder:
    """Counts saved tensors by scope (the branch whose forward is running, or None) while active."""

    def __init__(self, parts: list[tuple[nn.Module, ...]], dropped: frozenset[int]) -> None:
        self.parts = parts  # per branch: its module and its tail (post-norms), all in its scope
        self.dropped = dropped
        self.stack: list[int] = []
        self.packs: list[weakref.ref[_Packed]] = []
        self.untracked: list[torch.Tensor] = []
        self.dropped_packs = 0

    def pack(self, t: torch.Tensor) -> _Packed:
        scope = self.stack[-1] if self.stack else None
        if scope is not None and scope in self.dropped:
            self.dropped_packs += 1
        packed = _Packed(t.detach(), scope)
        self.packs.append(weakref.ref(packed))
        return packed

    @staticmethod
    def unpack(packed: _Packed) -> torch.Tensor:
        return packed.tensor

    @contextmanager
    def recording(self) -> Iterator[None]:
        def enter(index: int) -> Callable[..., None]:
            return lambda module, args: self.stack.append(index)

        def leave(module: nn.Module, args: tuple, output: object) -> None:
            self.stack.pop()  # returns None: the output is left as it is

        handles = []
        for index, parts in enumerate(self.parts):
            for module in parts:
                handles.append(module.register_forward_pre_hook(enter(index)))
                handles.append(module.register_forward_hook(leave, always_call=True))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            for h in handles:
                h.remove()

    def count(self, excluded: set[tuple[object, int]]) -> tuple[int, list[int]]:
        """(total, per-branch exclusive bytes) over the packs the graph still holds."""
        gc.collect()  # graph parts cut off from the loss (e.g. a dropped branch's pre-norm) go now
        scopes: dict[tuple[object, int, int], set[int | None]] = {}
        for ref in self.packs:
            packed = ref()
            if packed is None:
                continue
            key = _storage_key(packed.tensor)
            if key is None or key[2] == 0 or key[:2] in excluded:
                continue
            scopes.setdefault(key, set()).add(packed.scope)
        per_branch = [0] * len(self.parts)
        for key, where in scopes.items():
            if len(where) == 1 and (scope := next(iter(where))) is not None:
                per_branch[scope] += key[2]
        return sum(key[2] for key in scopes), per_branch


def _controller(target: DropBPController | nn.Module) -> DropBPController:
    if isinstance(target, DropBPController):
        return target
    if isinstance(target, nn.Module):
        ctl = controller_of(target)
        if ctl is not None:
            return ctl
        raise ValueError(
            "saved_bytes needs the model's branches: call ctl = dropbp.apply(model, drop_rate, pattern='uniform') "
            "first and pass ctl (or the model it is attached to)"
        )
    raise TypeError(f"expected a DropBPController or the nn.Module it is attached to, got {type(target).__name__}")


def _pattern(ctl: DropBPController, pattern: Collection[int | str]) -> frozenset[int]:
    names = [b.name for b in ctl.branches]
    if isinstance(pattern, (str, bytes)) or not isinstance(pattern, Collection):
        raise TypeError(f"pattern must be a collection of branch names or indices, got {pattern!r}")
    out = set()
    for item in pattern:
        if isinstance(item, str):
            if item not in names:
                raise ValueError(f"pattern names {item!r}, which is not a branch; branches are ctl.branches[i].name")
            out.add(names.index(item))
        elif isinstance(item, int) and not isinstance(item, bool) and 0 <= item < len(names):
            out.add(item)
        else:
            raise ValueError(f"pattern entry {item!r} is neither a branch name nor an index in [0, {len(names)})")
    return frozenset(out)


def _closure(model: nn.Module, batch: Batch) -> Callable[[], torch.Tensor]:
    if callable(batch) and not isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, torch.Tensor):
        return lambda: model(input_ids=batch, labels=batch).loss
    if isinstance(batch, Mapping):
        return lambda: model(**batch).loss
    raise TypeError(
        "batch must be input ids (a tensor, used as labels too), a dict of model inputs with labels, "
        f"or a closure returning the loss; got {type(batch).__name__}"
    )


def _measure(
    ctl: DropBPController, run: Callable[[], torch.Tensor], pattern: frozenset[int]
) -> tuple[int, list[int], int]:
    model = ctl.model
    excluded = {(str(t.device), t.untyped_storage().data_ptr()) for t in (*model.parameters(), *model.buffers())}
    recorder = _Recorder([b.parts for b in ctl.branches], pattern)
    with ctl.forcing(pattern), recorder.recording():
        loss = run()
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"the forward must return the loss tensor, got {type(loss).__name__}")
    total, per_branch = recorder.count(excluded)
    del loss
    return total, per_branch, recorder.dropped_packs


def saved_bytes(
    target: DropBPController | nn.Module,
    batch: Batch,
    pattern: Collection[int | str] = (),
    *,
    compare_full: bool = True,
) -> SavedBytes:
    """Bytes autograd keeps for backward after one training forward that drops exactly ``pattern``.

    The forward runs through the controller's own drop path (dropped branches without autograd), with
    the pattern forced as calibration forces it: no step is taken and no pattern drawn. No backward
    runs, so ``.grad`` is untouched.

    Args:
        target: the controller from ``dropbp.apply`` (or the model it is attached to).
        batch: input ids (used as labels too), a dict of model inputs including labels, or a closure
            that runs the forward and returns the loss.
        pattern: the branches to drop, by name (``ctl.branches[i].name``) or index; empty: full backprop.
        compare_full: also measure the same forward with nothing dropped (``full_total``).
    """
    ctl = _controller(target)
    model = ctl.model
    if not model.training or not torch.is_grad_enabled():
        raise RuntimeError("saved_bytes measures a training forward: call model.train() and leave grad mode on")
    dropped = _pattern(ctl, pattern)
    run = _closure(model, batch)
    total, per_branch, packs = _measure(ctl, run, dropped)
    full = None
    if compare_full:
        full = total if not dropped else _measure(ctl, run, frozenset())[0]
    names = tuple(ctl.branches[i].name for i in sorted(dropped))
    return SavedBytes(total, tuple(per_branch), names, packs, full)


def branch_bytes(target: DropBPController | nn.Module, batch: Batch) -> list[int]:
    """Per branch, the bytes that dropping it alone frees: full backprop's ``total`` minus that of the
    forward dropping only this branch (its own saved tensors and those of ops that feed only it, such
    as its pre-norm). N + 1 forwards. For sequential pre-norm layers these add up: dropping a set frees
    their sum, unless a storage is shared by every branch of the set and nothing else (e.g. rotary
    tables when every attention branch drops)."""
    ctl = _controller(target)
    full = saved_bytes(ctl, batch, (), compare_full=False).total
    return [full - saved_bytes(ctl, batch, (i,), compare_full=False).total for i in range(len(ctl.branches))]
