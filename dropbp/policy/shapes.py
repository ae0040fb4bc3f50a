"""Drop shapes: how a mean drop rate becomes per-branch rates and each step's pattern; one class each, one registry.

A shape answers four questions for the policy (:mod:`dropbp.policy.drop_policy`), which asks nothing else of it:
its own rates for a FLOP-weighted mean drop rate and the branches' costs (:meth:`DropShape.rates`), which given
rates it can realise (:meth:`DropShape.check_rates`), the sampler that draws its patterns (:meth:`DropShape.sampler`),
and the most branches a step keeps (:meth:`DropShape.most_kept`, what the memory bound holds a step to); its class
says whether calibration can allocate rates for it (:attr:`DropShape.calibrates`). ``DropBPOptions.pattern`` names a
shape; :func:`register_shape` adds a user's own in one call, and no module outside this one compares shape names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from dropbp.policy.allocation import cut_rates, cut_reaches
from dropbp.policy.never_drop_all import SUM_TOLERANCE, check_cut_rates, check_drop_rate, check_rates
from dropbp.policy.sampler import CutSampler, PatternSampler

__all__ = ["CutShape", "DropShape", "UniformShape", "get_shape", "register_shape", "shape_names"]


class DropShape:
    """A pattern shape: subclass it, set :attr:`name`, override :meth:`rates` (and what else differs), then
    :func:`register_shape`. The base class is the paper's fixed-count shape: every branch dropped at its own rate
    wherever it sits, ``floor`` or ``ceil`` of the rates' sum dropped in every step (:class:`PatternSampler`)."""

    #: The name ``pattern=`` takes.
    name: ClassVar[str] = ""
    #: Whether calibration (``ctl.calibrate``, the Trainer's ``calibrate_at``) can allocate rates for this shape:
    #: allocated rates are any rates :meth:`check_rates` accepts.
    calibrates: ClassVar[bool] = False
    #: Whether patterns are nested (a kept branch keeps every branch above it): the keep rule
    #: (:func:`~dropbp.policy.never_drop_all.keep_a_trainable_branch`) then always rescues the same branch, which so
    #: never drops; counted in the policy's drop probabilities.
    nested: ClassVar[bool] = False

    def rates(self, flops: Sequence[float], drop_rate: float) -> list[float]:
        """The shape's own per-branch rates whose FLOP-weighted mean is ``drop_rate``; a ValueError saying what to do
        where the shape cannot reach it over these branches."""
        raise NotImplementedError(f"the drop shape {type(self).__name__} must define rates(flops, drop_rate)")

    def reaches(self, flops: Sequence[float], drop_rate: float) -> bool:
        """Whether :meth:`rates` gives ``drop_rate`` over branches of these costs without raising."""
        try:
            self.rates(flops, drop_rate)
        except ValueError:
            return False
        return True

    def check_rates(self, rates: Sequence[float], num_branches: int) -> list[float]:
        """``rates`` (one per branch) as floats where this shape can realise them with no step dropping every branch,
        else a ValueError saying why."""
        return check_rates(rates, num_branches)

    def sampler(self, rates: Sequence[float], seed: int, max_patterns: int | None) -> PatternSampler:
        """The sampler of this shape's patterns at these rates (a pure function of seed and pattern index; a pool of
        ``max_patterns`` patterns where given)."""
        return PatternSampler(rates, seed, max_patterns)

    def most_kept(self, num_branches: int, drop_rate: float) -> int:
        """The most branches that store activations in a step at ``drop_rate`` under the memory bound: what a
        fixed-count shape keeps at most, ``N - floor(drop_rate x N)``."""
        return num_branches - math.floor(drop_rate * num_branches + 1e-9)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class UniformShape(DropShape):
    """The paper's patterns: every branch at the mean rate, the only shape calibration allocates for."""

    name = "uniform"
    calibrates = True

    def rates(self, flops: Sequence[float], drop_rate: float) -> list[float]:
        return [check_drop_rate(drop_rate, len(flops))] * len(flops)

    def reaches(self, flops: Sequence[float], drop_rate: float) -> bool:
        n = len(flops)
        return drop_rate < 1.0 and drop_rate * n <= n - 1 + SUM_TOLERANCE


class CutShape(DropShape):
    """Each step draws a depth and drops every branch below it (``dropbp.apply``'s default): rates falling with
    depth (:func:`~dropbp.policy.allocation.cut_rates`), the top branch always kept."""

    name = "cut"
    nested = True

    def rates(self, flops: Sequence[float], drop_rate: float) -> list[float]:
        return cut_rates(flops, drop_rate)

    def reaches(self, flops: Sequence[float], drop_rate: float) -> bool:
        return drop_rate < 1.0 and cut_reaches(flops, drop_rate)

    def check_rates(self, rates: Sequence[float], num_branches: int) -> list[float]:
        return check_cut_rates(rates, num_branches)

    def sampler(self, rates: Sequence[float], seed: int, max_patterns: int | None) -> PatternSampler:
        return CutSampler(rates, seed, max_patterns)


_SHAPES: dict[str, DropShape] = {}


def register_shape(shape: DropShape) -> DropShape:
    """Make ``shape`` what ``pattern=shape.name`` means from now on (in this process); returns it. A name already
    registered to another class is refused: a different shape needs a different name."""
    if not isinstance(shape, DropShape):
        raise TypeError(f"register_shape takes a dropbp.policy.shapes.DropShape instance, got {type(shape).__name__}")
    if not isinstance(shape.name, str) or not shape.name:
        raise ValueError(f"{type(shape).__name__} needs a name (the class attribute name = '...') to be registered")
    known = _SHAPES.get(shape.name)
    if known is not None and type(known) is not type(shape):
        raise ValueError(
            f"the drop shape name {shape.name!r} is taken by {type(known).__name__}; give {type(shape).__name__} "
            "another name"
        )
    _SHAPES[shape.name] = shape
    return shape


def shape_names() -> tuple[str, ...]:
    """The names ``pattern=`` takes, in registration order."""
    return tuple(_SHAPES)


def get_shape(name: str) -> DropShape:
    """The registered shape of this name (a KeyError naming those registered where none is)."""
    try:
        return _SHAPES[name]
    except KeyError:
        raise KeyError(f"no drop shape named {name!r}; registered: {', '.join(_SHAPES)}") from None


register_shape(CutShape())
register_shape(UniformShape())
