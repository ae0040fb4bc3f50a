"""The features attached to one controller, as one object: what the controller calls at each point of the protocol.

:class:`AttachedFeatures` checks features before anything is attached, attaches and removes them as the options
change, gathers their modules and hooks (copies and pickles leave them out) and their states, and loads states all or
nothing (:mod:`dropbp.features.base` states the protocol each feature implements).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from dropbp.features.base import Feature
from dropbp.features.host import Host

__all__ = ["AttachedFeatures"]


class AttachedFeatures:
    """The features on one model; ``framework``: a DeepSpeed engine holds its gradients (features may refuse it)."""

    def __init__(self, model: nn.Module, framework: bool) -> None:
        self._model = model
        self._framework = framework
        self._features: list[Feature] = []

    def by_key(self) -> dict[str, Feature]:
        return {f.key: f for f in self._features}

    def check_new(self, wanted: Sequence[Feature]) -> list[Feature]:
        """Those of ``wanted`` not attached yet, each checked on the model (a refusal raises before anything
        changes)."""
        new = [f for f in wanted if f not in self._features]
        for feature in new:
            if feature.attached:
                raise ValueError(f"this {type(feature).__name__} is attached to another controller: make one per model")
            feature.check(self._model, self._framework)
        return new

    def follow(self, wanted: Sequence[Feature], host: Host, attached: Callable[[], None]) -> None:
        """Remove the features not in ``wanted``, attach those new (checked by :meth:`check_new`), then call
        ``attached`` where the set changed; all or nothing: where an ``attach`` raises, those attached here are removed
        and those removed here attached again before it propagates."""
        before = list(self._features)
        gone = [f for f in before if f not in wanted]
        new = [f for f in wanted if f not in before]
        for feature in gone:
            feature.remove()
            self._features.remove(feature)
        try:
            for feature in new:
                feature.attach(host)
                self._features.append(feature)
        except BaseException:
            for feature in reversed(new):
                if feature.attached:  # attached here (the failing one too, where it got as far as the protocol's part)
                    feature.remove()
            self._features = [f for f in before if f not in gone]
            for feature in gone:  # back, in the order attached now
                feature.attach(host)
                self._features.append(feature)
            raise
        if gone or new:
            attached()

    def modules(self) -> list[nn.Module]:
        return [m for f in self._features for m in f.modules()]

    def handles(self) -> list[RemovableHandle]:
        return [h for f in self._features for h in f.handles()]

    def states(self) -> dict[str, Any]:
        """Each feature's state under its key (those that have one)."""
        return {f.key: own for f in self._features if (own := f.state_dict()) is not None}

    @contextmanager
    def loading(self, features: Sequence[Feature], state: dict[str, Any]) -> Iterator[None]:
        """Load each of ``features``' entry of ``state`` (checked first), then run the block; if it raises, every
        feature loaded gets its own state back (all or nothing)."""
        loading = [f for f in features if f.key in state]
        for feature in loading:
            feature.check_state(state[feature.key])
        before = [(f, f.state_dict()) for f in loading]
        try:
            for feature in loading:
                feature.load_state_dict(state[feature.key])
            yield
        except Exception:
            for feature, own in before:
                if own is not None:
                    feature.load_state_dict(own)
            raise

    def remove(self) -> None:
        for feature in reversed(self._features):
            feature.remove()
        self._features = []
