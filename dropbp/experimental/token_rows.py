"""Token rows: which linear maps of a branch work row by row (:func:`row_local_linears`), and how a device gathers and
places the rows for token drops (:func:`row_ops`: the device's part of a token-dropped backward).

Token drops are experimental, so their row operations live here, not in the device interface
(:class:`dropbp.backends.Backend`): :func:`row_ops` picks them from what the backend is. Eager devices gather exactly
the kept rows and copy them back in place (:class:`GatheredRows`); a lazy-graph device in lazy mode rounds the count up
to one of :data:`ROW_BUCKETS` fixed counts and places rows with an operation its graphs compile, so that selections
share compiled graphs (:class:`BucketedRows`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from dropbp.architectures import EXPERTS, ROW_LOCAL_ATTENTION_PROJECTIONS
from dropbp.backends import Backend
from dropbp.backends.base import LazyGraphBackend
from dropbp.execution.discovery import Branch

__all__ = [
    "ROW_BUCKETS",
    "BucketedRows",
    "GatheredRows",
    "RowLocalLinear",
    "recomputes_on_kept_rows",
    "row_local_linears",
    "row_ops",
]

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


class RowLocalLinear(NamedTuple):
    """A linear map inside a branch whose backward can run on the branch's kept token rows (token drops)."""

    name: str  # its path below the branch module
    module: nn.Module
    transposed: bool  # transformers' Conv1D: ``x @ weight + bias``


def _gatherable(module: nn.Module) -> bool | None:
    """Whether ``module`` is a linear map token drops can gather (True), a linear layer they cannot (False: a
    4-bit or otherwise replaced forward), or no linear layer (None)."""
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return tuple(module.weight.shape) == (module.nx, module.nf)
    if isinstance(module, nn.Linear):
        plain = type(module).forward is nn.Linear.forward and module.weight.is_floating_point()
        return plain and tuple(module.weight.shape) == (module.out_features, module.in_features)
    return None


def row_local_linears(branch: Branch) -> tuple[list[RowLocalLinear], list[str]]:
    """The linear maps of ``branch`` whose output row ``t`` reaches its output only at row ``t`` (all of an MLP
    branch; an attention branch's query and output projections, :data:`ROW_LOCAL_ATTENTION_PROJECTIONS`), and
    the names of such layers whose backward cannot be gathered (they run full rows)."""
    found, full = [], []
    for name, module in branch.module.named_modules():
        if not name or (branch.kind == "attn" and name.split(".")[0] not in ROW_LOCAL_ATTENTION_PROJECTIONS):
            continue
        if EXPERTS in name.split("."):  # an expert's rows are the tokens routed to it, not the branch's
            continue
        gatherable = _gatherable(module)
        if gatherable:
            found.append(RowLocalLinear(name, module, type(module).__name__ == "Conv1D"))
        elif gatherable is False:
            full.append(f"{branch.name}.{name}")
    return found, full


def recomputes_on_kept_rows(branch: Branch) -> bool:
    """Whether token drops may recompute ``branch`` on its kept rows alone, under activation checkpointing: an MLP
    branch without a tail or experts, so that each row of its one output tensor is a function of the same row of its
    input alone (:mod:`dropbp.experimental.token_backward`)."""
    paths = (name.split(".") for name, _ in branch.module.named_modules())
    return branch.kind == "mlp" and not branch.tail and not any(EXPERTS in path for path in paths)
