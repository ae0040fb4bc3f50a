"""Importance weights (0.3's ``unbiased=True``): a kept branch's own parameters get their gradient times
``1 / (1 - r)``, ``r`` how often the branch is dropped where its forward drew its pattern (under warm-up or a time
schedule too); the residual stream is left alone. With cut patterns every branch's expected gradient is then exactly
full backprop's. Measured and not better (benchmarks/results/convergence_levers_lora_pydoc.md); its expectation per
branch: docs/patterns.md.

:class:`ImportanceWeights` is a feature that plugs into the kept branch's gradient
(:class:`dropbp.execution.hooks.KeptGradient`), from the next training forward on.
"""

from __future__ import annotations

from typing import Any

from dropbp.experimental.lr_compensation import compensation
from dropbp.features.base import Feature, register_feature
from dropbp.features.host import Host

__all__ = ["ImportanceWeights"]


@register_feature
class ImportanceWeights(Feature):
    """Importance weights on every kept branch: its own parameters' gradient times ``1 / (1 - r)`` for its drop
    probability ``r`` at the forward that kept it (1 where ``r`` is 1: such a branch is kept only by the keep rule)."""

    key = "importance_weights"
    replaces = {"unbiased": "features=[dropbp.experimental.ImportanceWeights()] (was unbiased=True)"}

    @classmethod
    def from_flat(cls, settings: dict[str, Any]) -> ImportanceWeights | None:
        return cls() if settings.pop("unbiased", False) else None

    def attach(self, host: Host) -> None:
        if host.hooks.kept_gradient is not None:
            raise ValueError(f"the kept branches' gradient already has a weight ({host.hooks.kept_gradient!r})")
        super().attach(host)
        host.hooks.kept_gradient = self

    def weights(self, drop_probabilities: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(1.0 if r >= 1.0 else compensation(r) for r in drop_probabilities)

    def remove(self) -> None:
        if self.attached and self.host.hooks.kept_gradient is self:
            self.host.hooks.kept_gradient = None
        super().remove()

    def __repr__(self) -> str:
        return "ImportanceWeights()"
