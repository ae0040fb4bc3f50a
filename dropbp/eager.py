"""Code that must never be traced into a ``torch.compile`` graph.

Every DropBP hook reads the step's drop pattern, a Python value: were it traced, Dynamo would guard
each graph on the pattern and recompile for every new one. :func:`outside_graphs` makes a function
a graph break instead (see :mod:`dropbp.compile` for the whole recipe). A leaf module, so that every
hook module can import it without cycles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["outside_graphs"]

F = TypeVar("F", bound=Callable[..., Any])


def outside_graphs(fn: F) -> F:
    """``fn`` always runs eagerly, also when called from code ``torch.compile`` traces (a graph break)."""
    return torch.compiler.disable(fn)
