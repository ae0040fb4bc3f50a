"""How a device gathers and places token rows for token drops: the device's part of a token-dropped backward.

Token drops are experimental, so their row operations live here, not in the device interface
(:class:`dropbp.backends.Backend`): :func:`row_ops` picks them from what the backend is. Eager devices gather exactly
the kept rows and copy them back in place (:class:`GatheredRows`); a lazy-graph device in lazy mode rounds the count up
to one of :data:`ROW_BUCKETS` fixed counts and places rows with an operation its graphs compile, so that selections
share compiled graphs (:class:`BucketedRows`).
"""

from __future__ import annotations

import torch

from dropbp.backends import Backend
from dropbp.backends.base import LazyGraphBackend

__all__ = ["ROW_BUCKETS", "BucketedRows", "GatheredRows", "row_ops"]

#: Fixed token-row counts a lazy-graph device runs a token-dropped branch's backward on (equal steps of the rows).
ROW_BUCKETS = 8


class GatheredRows:
    """Eager devices: any number of rows, copied back in place."""

    #: Whether every distinct graph is compiled: token drops then keep one share for every branch
    #: (:func:`dropbp.experimental.token_selection.token_shares`).
    compiles_graphs = False

    def kept_row_count(self, kept: int, rows: int) -> int:
        """How many token rows a branch's backward runs on when the selection keeps ``kept`` of its ``rows``."""
        return kept

    def place_rows(self, part: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
        """A ``(rows, width)`` tensor of zeros with ``part``'s rows at ``index`` (distinct): the input gradient of a
        token-dropped linear map, copied in place (``index_copy_``: no second full copy)."""
        return part.new_zeros(rows, part.shape[1]).index_copy_(0, index, part)


class BucketedRows(GatheredRows):
    """A lazy-graph device in lazy mode: row counts on :data:`ROW_BUCKETS` fixed steps, rows placed by ``scatter_add``
    (``index_copy`` falls back to the host on the lazy engine, cutting the graph)."""

    compiles_graphs = True

    def kept_row_count(self, kept: int, rows: int) -> int:
        """``kept`` rounded up to the next of :data:`ROW_BUCKETS` equal steps of ``rows``: at most that many backward
        graphs per branch shape, whatever the selection."""
        if kept <= 0 or kept >= rows:
            return kept
        bucket = -(-rows // ROW_BUCKETS)
        return min(rows, -(-kept // bucket) * bucket)

    def place_rows(self, part: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
        spread = index.view(-1, 1).expand(-1, part.shape[1])  # indices distinct: each row placed once
        return part.new_zeros(rows, part.shape[1]).scatter_add_(0, spread, part)


def row_ops(backend: Backend) -> GatheredRows:
    """The row operations of ``backend``: bucketed where it compiles every graph (a lazy-graph device in lazy mode)."""
    return BucketedRows() if isinstance(backend, LazyGraphBackend) and backend.lazy else GatheredRows()
