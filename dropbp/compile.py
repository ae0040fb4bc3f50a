"""``torch.compile`` with DropBP: the drop decision stays out of compiled graphs, so recompiles stay bounded.

Dynamo guards every compiled graph on the Python values it read while tracing. Were the controller's
hooks traced, each graph would be guarded on the current drop pattern and recompiled for every new
pattern (hundreds over a run, far past Dynamo's cache limit). So every DropBP hook runs eagerly
(:func:`outside_graphs`); a compiled branch sees only the grad mode its hook set: grad on (kept) or
off (dropped). Grad mode is part of Dynamo's global-state guard, so each branch ``forward`` code
gets exactly two graphs, however many layers share it and whatever the patterns.

The recipe is :func:`compile_branches`: compile the branch modules themselves (regional compilation,
the usual way to compile a transformer). Compiling the whole model (``model.compile()``) is also bounded
(graphs break at every hook) but not exact: a compiled region whose output feeds only dropped branches
(the norm in front of a dropped MLP) gets a zero gradient instead of none from AOTAutograd, and an
optimizer such as AdamW then still moves those weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from torch import nn

from .eager import outside_graphs

__all__ = ["compile_branches", "outside_graphs"]


class _Branch(Protocol):
    module: nn.Module


class _HasBranches(Protocol):
    @property
    def branches(self) -> Sequence[_Branch]: ...


def compile_branches(controller: _HasBranches, **options: Any) -> None:
    """``module.compile(**options)`` for every branch of ``controller``: two graphs per branch type.

    Call after :func:`dropbp.apply`.

    Args:
        controller: what :func:`dropbp.apply` returned.
        **options: go to ``torch.compile`` (``mode``, ``backend``, ``fullgraph``, ``dynamic``, ...).
            Everything else in the model (embeddings, norms, residual adds, head) stays eager.
    """
    for branch in controller.branches:
        branch.module.compile(**options)
