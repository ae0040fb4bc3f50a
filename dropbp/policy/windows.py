"""Optimizer-step windows: the index each training forward's pattern is drawn at, so that stratified groups and a
pattern pool start at every optimizer step even where an epoch ends with a short window.

A run of epochs of ``forwards_per_epoch`` micro-batches at ``accumulation`` micro-batches per optimizer step ends each
epoch with a short window where the epoch is not a multiple of the accumulation (transformers' Trainer does). Forward
``s`` of epoch ``e`` at position ``p`` takes the pattern index ``e * W + p``, ``W`` the epoch rounded up to whole
windows: every window starts at a multiple of the accumulation, as in a run without short windows, and the indices a
short window leaves out are never drawn. Without windows the index is the forward. Pure functions of the windows.
"""

from __future__ import annotations

from dataclasses import dataclass

from dropbp.checks import check_int

__all__ = ["Windows"]


@dataclass(frozen=True)
class Windows:
    """Epochs of ``forwards_per_epoch`` training forwards, ``accumulation`` forwards per optimizer step."""

    forwards_per_epoch: int
    accumulation: int

    def __post_init__(self) -> None:
        check_int("forwards_per_epoch", self.forwards_per_epoch, 1)
        check_int("accumulation", self.accumulation, 1)

    @classmethod
    def of(cls, value: object) -> Windows | None:
        """``value`` given as ``windows`` (a pair, or None) made one, or a TypeError / ValueError naming it."""
        if value is None:
            return None
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            wanted = "(training forwards per epoch, gradient accumulation steps), or None"
            raise TypeError(f"windows must be {wanted}, got {value!r:.80}")
        return cls(check_int("windows[0]", value[0], 1), check_int("windows[1]", value[1], 1))

    @property
    def span(self) -> int:
        """Pattern indices per epoch: the epoch rounded up to whole windows."""
        return -(-self.forwards_per_epoch // self.accumulation) * self.accumulation

    def index(self, forward: int) -> int:
        """The pattern index of training forward ``forward`` (counted from 0 over the whole run)."""
        epoch, position = divmod(forward, self.forwards_per_epoch)
        return epoch * self.span + position

    def forward(self, index: int) -> int:
        """The first training forward whose pattern index is ``index`` or more."""
        epoch, position = divmod(index, self.span)
        return epoch * self.forwards_per_epoch + min(position, self.forwards_per_epoch)

    def group_size(self, index: int, group: int) -> int:
        """How many forwards draw in the group of ``group`` consecutive indices that holds ``index``: ``group``, or
        fewer for the group a short window ends (where ``group`` divides the accumulation; otherwise groups cross
        windows anyway, and each keeps its ``group`` slices)."""
        if self.accumulation % group:
            return group
        start = index - index % group
        epoch_end = index - index % self.span + self.forwards_per_epoch
        return min(group, epoch_end - start)
