"""Activation checkpointing that does not recompute dropped branches.

When a dropped branch runs inside a checkpointed region during a training forward, its output is held, and when
checkpointing calls the branch again during backward (the recomputation), the branch hands back that tensor instead
of running, provided the random generators stand where they stood before its first call. A recomputation obeys the
pattern of the forward it replays: a non-re-entrant region is known by the object checkpointing keeps for it
(:func:`forward_region`, :func:`recomputed_region`), a re-entrant one by its autograd node, found in the forward's
graph when the forward ends (:func:`reentrant_regions`). Nothing depends on an output being held: without one the
branch is recomputed, with the same pattern. What is held, for how long, and why: docs/checkpointing.md.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Container, Mapping, Sequence
from itertools import chain
from typing import Any

import torch
from torch import nn

from dropbp.backends import Backend
from dropbp.execution.patching import ForwardPatch
from dropbp.internals import at_backward_end, backward_task, captured, checkpoint_hook, running_node

__all__ = ["BranchCache", "RecomputeCache", "forward_region", "in_backward", "recomputed_region", "reentrant_regions"]

RngState = list[torch.Tensor]


def in_backward() -> bool:
    """Whether the autograd engine runs a backward in this thread (where checkpointing recomputes)."""
    return backward_task() != -1


def forward_region() -> object | None:
    """The non-re-entrant checkpointed region a forward runs in now, as checkpointing keeps it for the backward
    (the call's frame object); None outside every such region."""
    hook = checkpoint_hook()
    return None if hook is None else captured(hook, "frame")


def recomputed_region() -> object | None:
    """During a backward, the region being recomputed: the non-re-entrant call's frame object, as
    :func:`forward_region` gave it, or the re-entrant call's autograd node, as :func:`reentrant_regions` finds it."""
    hook = checkpoint_hook()
    return running_node() if hook is None else captured(hook, "target_frame_ref")()


def reentrant_regions(output: object, known: Container[object]) -> list[object]:
    """The autograd nodes of the re-entrant checkpointed regions ``output`` (a tensor, or a mapping or sequence of
    them) was computed from, found by walking its autograd graph; ``known`` nodes and what lies behind them are
    not walked again."""
    stack = [t.grad_fn for t in _tensors(output)]
    seen: set[object] = set()
    found = []
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in known:
            continue
        seen.add(node)
        if node.name() == "CheckpointFunctionBackward":
            found.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _tensors(output: object, depth: int = 0) -> list[torch.Tensor]:
    """The tensors in a model's output: itself, or inside sequences, mappings, dataclasses and plain objects'
    attributes (a wrapper's own output type), a few levels deep."""
    if isinstance(output, torch.Tensor):
        return [output]
    if depth > 4 or isinstance(output, (str, bytes, type, nn.Module)):
        return []
    if dataclasses.is_dataclass(output):
        output = [getattr(output, f.name) for f in dataclasses.fields(output)]
    elif not isinstance(output, (Mapping, list, tuple)) and hasattr(output, "__dict__"):
        output = list(vars(output).values())
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item, depth + 1)]
    return []


def _device_of(module: nn.Module) -> torch.device:
    tensor = next(chain(module.parameters(), module.buffers()), None)
    return torch.device("cpu") if tensor is None else tensor.device


def _same(a: RngState, b: RngState) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class BranchCache:
    """The held output of one dropped branch and the ``forward`` that hands it back."""

    def __init__(self, module: nn.Module, owner: RecomputeCache) -> None:
        self._module = module
        self._owner = owner
        self._output: Any = None
        self._held = False
        self._device = torch.device("cpu")
        self._rng_before: RngState = []
        self._rng_after: RngState | None = None  # None: the call drew no random numbers
        self._calls = 0  # dropped calls during the current training forward
        self._region: object | None = None  # the checkpointed region the held output came from
        self._patch = ForwardPatch(module, self._make_forward())  # one forward per branch: compiled callers see one

    def _make_forward(self) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._held and in_backward() and self._owner.recomputed() is self._region:
                if self._rng_after is None:
                    return self.take()
                if _same(self._owner.backend.rng_state(self._device), self._rng_before):
                    self._owner.backend.set_rng_state(self._device, self._rng_after)
                    return self.take()
                self.release()
            return self._patch.original()(*args, **kwargs)

        return forward

    def on_call(self, dropped: bool) -> bool:
        """Called as the branch starts; True when its output is to be held for the recomputation."""
        owner = self._owner
        if in_backward():
            owner.release_after_backward()
            return False
        if not owner.recording:
            return False
        owner.branch_starts(dropped)
        if not torch.is_grad_enabled():
            owner.reentrant = True  # a re-entrant region: its forward runs without grad
        if not dropped:
            return False
        if self._calls == 0:
            owner.used.append(self)
        self._calls += 1
        if self._calls > 1:
            self.release()
            return False
        if torch.is_grad_enabled() and checkpoint_hook() is None:
            return False  # not in a checkpointed region: nothing recomputes this branch
        self._device = _device_of(self._module)
        self._rng_before = self._owner.backend.rng_state(self._device)
        return True

    def hold(self, output: Any) -> None:
        after = self._owner.backend.rng_state(self._device)
        self._rng_after = None if _same(after, self._rng_before) else after
        self._output, self._held = output, True
        self._region = forward_region() or self._owner.forward_token  # re-entrant: known by its forward
        self._patch.install()
        region = checkpoint_hook()
        if region is not None:
            self._owner.pending.append((self, region))

    def take(self) -> Any:
        output = self._output
        self.release()
        return output

    def release(self) -> None:
        if not self._held:
            return
        self._output, self._held, self._region = None, False, None
        self._rng_before, self._rng_after = [], None
        self._patch.remove()

    def reset(self) -> None:
        self.release()
        self._calls = 0


class RecomputeCache:
    """One :class:`BranchCache` per branch, and the moments that bound what they hold."""

    def __init__(self, modules: Sequence[nn.Module], backend: Backend) -> None:
        #: The device backend: the random-number state a skipped recomputation must leave as it would have.
        self.backend = backend
        self.branches = [BranchCache(m, self) for m in modules]
        self.recording = False  # a training forward of the controlled model is under way
        self.reentrant = False  # a branch of this forward ran without grad (a re-entrant checkpointed region)
        #: Stands for the current training forward; a held re-entrant output is known by it.
        self.forward_token = object()
        self._forward_of: weakref.WeakKeyDictionary[object, object] = weakref.WeakKeyDictionary()
        #: Held in a non-re-entrant region, with the region, until a kept branch starts there.
        self.pending: list[tuple[BranchCache, object]] = []
        #: The branches dropped since the last clear (the only ones with anything to reset: a step that drops
        #: nothing resets nothing)
        self.used: list[BranchCache] = []
        self._release_task: int | None = None

    def begin_forward(self) -> None:
        self.clear()
        self.recording = True
        self.reentrant = False
        self.forward_token = object()

    def claim_reentrant_regions(self, output: object) -> list[object]:
        """The re-entrant regions the forward that made ``output`` ran (:func:`reentrant_regions`), each marked as
        that forward's, so their recomputation is handed the outputs it held; call as that forward ends."""
        nodes = reentrant_regions(output, self._forward_of)
        for node in nodes:
            self._forward_of[node] = self.forward_token
        return nodes

    def recomputed(self) -> object | None:
        """During a backward, what a held output's region is known by: the non-re-entrant region being recomputed,
        or the token of the forward whose re-entrant region is being recomputed."""
        region = recomputed_region()
        return None if region is None else self._forward_of.get(region, region)

    def branch_starts(self, dropped: bool) -> None:
        """A kept branch in a pending output's region means the region will be recomputed up to it;
        a branch outside that region means it ended without one, so the output will not be asked for."""
        if not self.pending:
            return
        region = checkpoint_hook()
        for branch, where in self.pending:
            if where is not region:
                branch.release()
        self.pending = [(b, r) for b, r in self.pending if r is region] if dropped else []

    def end_forward(self) -> None:
        self.branch_starts(dropped=True)  # outside every region: what is still pending is released
        self.recording = False

    def clear(self) -> None:
        for branch in self.used:
            branch.reset()
        self.used, self.pending = [], []
        self._release_task = None

    def release_after_backward(self) -> None:
        """Release everything once the running backward ends (outputs its recomputation never asked for)."""
        task = backward_task()
        if task != self._release_task:
            self._release_task = task
            at_backward_end(self.clear)
