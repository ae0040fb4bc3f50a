"""Stored activations bounded at every step (``memory_bound``): at most ``keep`` kept branches store theirs.

A step whose pattern keeps more than ``keep`` branches (the drop shape's ``most_kept``: by default what the uniform
shape keeps at most, ``N - floor(drop_rate x N)``) runs the layers of its lowest kept branches checkpointed (the
backend's ``checkpoint``: non-re-entrant ``torch.utils.checkpoint`` where the device has a generator module) until no
more than ``keep`` store activations, counting the inputs the checkpointed layers keep (:data:`INPUTS_PER_BRANCH`).
Gradients are the pattern's exactly, and a dropped branch inside such a layer is still not recomputed
(:mod:`dropbp.execution.recompute`). Layers already inside a checkpointed region (Hugging Face
``gradient_checkpointing``) are
left alone. A layer checkpointed here gets no key/value cache (keyword or positional, as GPT-2 passes it): exact when
the forward starts from an empty cache, since a layer then attends to its own keys only, and the recomputation must not
append to the cache again. A layer whose cache already holds tokens for it (a cached prefix: ``past_key_values`` /
``cache`` given to the model, PEFT prefix tuning) needs that cache, so it runs plainly, outside the bound, with a
warning the first time. Why, the unit checkpointed, and the measured peaks: docs/memory.md ("Stored activations
bounded at every step").
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dropbp.backends import Backend
from dropbp.execution.patching import ForwardPatch
from dropbp.internals import checkpoint_hook

__all__ = ["INPUTS_PER_BRANCH", "MemoryBound"]

#: A checkpointed unit still stores its input (one hidden state); the bound counts this many of them as one
#: branch's activations (a branch stores about 8 hidden states with LoRA, more in full fine-tuning: docs/memory.md).
INPUTS_PER_BRANCH = 8

#: Keyword arguments that carry a key/value cache into a model or a layer (Hugging Face names); in a checkpointed layer
#: they are set to None, as is any positional argument that is a cache object.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _is_cache(value: object) -> bool:
    """A Hugging Face cache object (``transformers.cache_utils.Cache`` or a subclass); transformers not imported."""
    return any(cls.__name__ == "Cache" for cls in type(value).__mro__)


def _layer_index(unit: nn.Module) -> int | None:
    """The decoder-layer index Hugging Face attention modules keep (``layer_idx``) inside ``unit``, if any."""
    for module in unit.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int):
            return index
    return None


def _tokens_held(cache: object, layer: int | None) -> int:
    """The tokens ``cache`` already holds for layer ``layer`` (a cache object's ``get_seq_length``; a ``(key,
    value)`` pair's key length; anything else not None counts as holding some)."""
    if _is_cache(cache):
        return int(cache.get_seq_length(layer or 0))
    if isinstance(cache, (tuple, list)) and cache and isinstance(cache[0], torch.Tensor):
        return int(cache[0].shape[-2])
    return 1


def _units(model: nn.Module, names: Sequence[str], modules: Sequence[nn.Module]) -> tuple[list[nn.Module], list[int]]:
    """The modules to checkpoint, and per branch the index of its own: the parent holding several branches
    (a decoder layer), else the branch module."""
    parents = [name.rpartition(".")[0] for name in names]
    shared = {p for p, n in Counter(parents).items() if p and n > 1}
    index: dict[int, int] = {}  # id of a unit -> its position in ``units``
    units: list[nn.Module] = []
    unit_of = []
    for parent, module in zip(parents, modules, strict=True):
        unit = model.get_submodule(parent) if parent in shared else module
        if id(unit) not in index:
            index[id(unit)] = len(units)
            units.append(unit)
        unit_of.append(index[id(unit)])
    return units, unit_of


def _checkpointed(
    unit: nn.Module,
    underneath: Callable[[], Callable[..., Any]],
    on_prefix: Callable[[int], None],
    backend: Backend,
) -> Callable[..., Any]:
    """A ``forward`` of ``unit`` that runs ``underneath()`` (the forward it patches) checkpointed, with no cache; or
    plainly, after ``on_prefix(tokens)``, when its cache already holds tokens for this layer (a cached prefix)."""
    layer = _layer_index(unit)

    def forward(*args: Any, **kwargs: Any) -> Any:
        original = underneath()
        if not torch.is_grad_enabled() or checkpoint_hook() is not None or _checkpoints_itself(unit):
            return original(*args, **kwargs)  # no graph, or checkpointed anyway: nothing stored
        caches = [v for v in args if _is_cache(v)] + [kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None]
        prefix = max((_tokens_held(cache, layer) for cache in caches), default=0)
        if prefix:  # recomputing would append to the cache again, and without it the layer loses the prefix
            on_prefix(prefix)
            return original(*args, **kwargs)
        args = tuple(None if _is_cache(value) else value for value in args)
        for key in _CACHE_KWARGS:
            if kwargs.get(key) is not None:
                kwargs[key] = None
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        return backend.checkpoint(original, *args, **kwargs)

    return forward


def _checkpoints_itself(unit: nn.Module) -> bool:
    """A Hugging Face layer with ``gradient_checkpointing`` on checkpoints its own forward."""
    return bool(getattr(unit, "gradient_checkpointing", False)) and unit.training


class MemoryBound:
    """Chooses, per training forward, the layers that run checkpointed, and checkpoints them for that forward.

    Args:
        model: the controlled model.
        names: the branches' names in ``model.named_modules()``, in branch order.
        modules: the branch modules, in branch order.
        backend: the device backend, whose :meth:`~dropbp.backends.Backend.checkpoint` runs a chosen layer.
    """

    def __init__(
        self, model: nn.Module, names: Sequence[str], modules: Sequence[nn.Module], backend: Backend
    ) -> None:
        self.units, self._unit_of = _units(model, names, modules)
        self._patches: list[ForwardPatch] = []
        for unit in self.units:
            holder: list[ForwardPatch] = []
            forward = _checkpointed(unit, lambda h=holder: h[0].original(), self._warn_prefix, backend)
            holder.append(ForwardPatch(unit, forward))
            self._patches += holder
        #: The units checkpointed in the forward under way.
        self.active: tuple[int, ...] = ()
        self._warned_prefix = False

    def select(self, dropped: frozenset[int], keep: int) -> tuple[int, ...]:
        """The units to checkpoint, those of the lowest kept branches first, until the kept branches that store
        activations, plus one branch per :data:`INPUTS_PER_BRANCH` checkpointed units, are at most ``keep``."""
        kept = [i for i in range(len(self._unit_of)) if i not in dropped]
        stored = len(kept)
        if stored <= keep:
            return ()
        per_unit = Counter(self._unit_of[i] for i in kept)
        chosen: list[int] = []
        for i in kept:  # bottom first
            unit = self._unit_of[i]
            if unit not in chosen:
                chosen.append(unit)
                stored -= per_unit[unit]
                if stored + math.ceil(len(chosen) / INPUTS_PER_BRANCH) <= keep:
                    break
        return tuple(chosen)

    def begin(self, dropped: frozenset[int], keep: int) -> None:
        """Checkpoint, for the forward starting now, the units :meth:`select` chooses."""
        self.end()
        self.active = self.select(dropped, keep)
        for unit in self.active:
            self._patches[unit].install()

    def _warn_prefix(self, prefix: int) -> None:
        if not self._warned_prefix:
            self._warned_prefix = True
            warnings.warn(
                f"dropbp memory_bound: a training forward continues a cached prefix ({prefix} tokens in a layer's "
                "key/value cache: past_key_values / cache, or PEFT prefix tuning); layers given such a cache run "
                "without the bound (gradients stay exact, their activations are stored), since recomputing one "
                "would append to the cache again. Forwards without a cached prefix keep the bound. Said once.",
                stacklevel=2,
            )

    def end(self) -> None:
        """The forward is over: no unit is checkpointed (a recomputation already holds what it runs)."""
        for unit in reversed(self.active):
            self._patches[unit].remove()
        self.active = ()
