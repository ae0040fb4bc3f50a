"""Stratified cuts (0.3's ``stratify``): a group of consecutive training forwards (an optimizer step's micro-batches)
draws its cut depths one in each equal slice of [0, 1). Measured and not better (docs/where-it-pays.md, "Stratified
cuts").

:class:`StratifiedCuts` is a feature that plugs into the policy's pattern draw (its ``pattern_draw``,
:class:`dropbp.policy.plugins.PatternDraw`): cut patterns drawn afresh each step, never from a pattern pool.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from dropbp.checks import check_int
from dropbp.features.base import Feature, register_feature
from dropbp.policy.sampler import CutSampler
from dropbp.policy.shapes import CutShape, DropShape
from dropbp.policy.windows import Windows

__all__ = ["StratifiedCutSampler", "StratifiedCuts", "stratified_depth"]


def stratified_depth(seed: int, group: int, step: int, size: int | None = None) -> float:
    """The cut depth ``u`` at pattern index ``step`` in groups of ``group`` indices, of which the first ``size``
    (default ``group``; fewer where a short window ends the group) draw: they take one point in each slice
    ``[k / size, (k + 1) / size)``, slices in a random order, at one random offset in the slice. Each ``u`` is
    uniform on [0, 1); it depends on (seed, step, size) only, not on the rates, so a warm-up that changes the rates
    inside a group keeps the group's slices."""
    size = group if size is None else size
    if not 0 <= step % group < size <= group:
        raise ValueError(f"index {step} is not among the first {size} of its group of {group}")
    rng = random.Random(f"stratified:{seed}:{size}:{step // group}")
    order = list(range(size))
    rng.shuffle(order)
    return (order[step % group] + rng.random()) / size


class StratifiedCutSampler(CutSampler):
    """Cut patterns whose depths are stratified over groups of ``group`` pattern indices (:func:`stratified_depth`):
    every branch keeps its exact rate, and a branch whose rate is at most ``1 - 1 / group`` is kept in at least one
    forward of every group. ``windows``: a group a short window ends has as many slices as forwards."""

    def __init__(self, rates: Sequence[float], seed: int, group: int, windows: Windows | None = None) -> None:
        super().__init__(rates, seed)
        self.group = group
        self.windows = windows

    def _draw(self, step: int) -> frozenset[int]:
        size = self.group if self.windows is None else self.windows.group_size(step, self.group)
        return self._below(stratified_depth(self.seed, self.group, step, size))


@register_feature
class StratifiedCuts(Feature):
    """Stratified cuts over each group of ``group`` consecutive training forwards (set it to the gradient
    accumulation steps): the group's cut depths are one draw in each of ``group`` equal slices of [0, 1), in a random
    order, with a fresh offset every group. Cut patterns only, drawn afresh (no pattern pool: ``max_patterns=None``,
    on a device without a default bound).

    Args:
        group: forwards per stratified group, at least 2.
    """

    key = "stratified_cuts"
    needed_to_resume = True
    replaces = {"stratify": "features=[dropbp.experimental.StratifiedCuts(group)] (was stratify=group)"}

    def __init__(self, group: int) -> None:
        super().__init__()
        self.group = check_int("group", group, 2)

    @property
    def pattern_draw(self) -> StratifiedCuts:
        """The policy's extension point (:class:`dropbp.policy.plugins.PatternDraw`): this object."""
        return self

    def check_draw(self, shape: DropShape, max_patterns: int | None) -> None:
        if not isinstance(shape, CutShape) or max_patterns is not None:
            raise ValueError(
                f"{self!r} stratifies cut patterns drawn afresh each step: it needs pattern='cut' (got "
                f"{shape.name!r}) and no pattern pool (max_patterns={max_patterns!r}: given, or the device's default "
                "bound where it compiles a graph per pattern, whose pool cycle is already stratified). Use "
                "pattern='cut' and max_patterns=None, or leave StratifiedCuts out"
            )

    def sampler(
        self, shape: DropShape, rates: Sequence[float], seed: int, windows: Windows | None
    ) -> StratifiedCutSampler:
        return StratifiedCutSampler(rates, seed, self.group, windows)

    @classmethod
    def from_flat(cls, settings: dict[str, Any]) -> StratifiedCuts | None:
        group = settings.pop("stratify", 1)
        if type(group) is int and group == 1:
            return None
        try:
            return cls(group)
        except (TypeError, ValueError) as error:
            raise type(error)(f"stratify: {error}") from None

    def config(self) -> dict[str, Any]:
        return {"group": self.group}

    @classmethod
    def migrate_state(cls, state: dict[str, Any], attached: Feature | None) -> dict[str, Any]:
        """0.3's ``stratify`` taken out; above 1 it needs this feature attached with that group."""
        if "stratify" not in state:
            return state
        rest = {k: v for k, v in state.items() if k != "stratify"}
        group = state["stratify"]
        if group == 1:
            return rest
        if not isinstance(attached, cls) or attached.group != group:
            raise ValueError(
                f"state was saved by dropbp 0.3 with stratify={group!r}: pass "
                f"features=[dropbp.experimental.StratifiedCuts({group!r})] to resume it"
            )
        return rest

    def __repr__(self) -> str:
        return f"StratifiedCuts({self.group})"
