"""``torch.compile`` with DropBP: hooks that never enter a compiled graph, so recompiles stay bounded.

Every DropBP hook reads the step's drop pattern, a Python value: were it traced, Dynamo would guard each graph on the
pattern and recompile for every new one. :func:`outside_graphs` makes a hook a graph break instead, so a compiled
branch sees only the grad mode its hook set, on (kept) or off (dropped): each branch ``forward`` code gets exactly two
graphs, however many layers share it and whatever the patterns. The recipe is :func:`compile_branches` (compile the
branch modules themselves). Compiling the whole model (``model.compile()``) or whole layers is bounded but not exact: a
compiled region whose output feeds only dropped branches gets a zero gradient instead of none. The first training
forward in which a branch runs inside such a region says so, once (:class:`EnclosingCompileWarning`). Why, and what was
measured: docs/scaling-out.md ("torch.compile").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dropbp.checks import Once

__all__ = ['EnclosingCompileWarning', 'compile_branches', 'outside_graphs']


F = TypeVar("F", bound=Callable[..., Any])


def outside_graphs(fn: F) -> F:
    """``fn`` always runs eagerly, also when called from code ``torch.compile`` traces (a graph break)."""
    return torch.compiler.disable(fn)


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


class EnclosingCompileWarning:
    """A forward pre-hook on the module around each branch (its layer) that warns, once, when that module is
    traced by ``torch.compile`` in a training forward: the branch then runs inside a compiled region larger
    than itself (``torch.compile(model)``, ``model.compile()``, compiled layers).

    The hook itself is traced (not :func:`outside_graphs`): ``torch.compiler.is_compiling()`` is true only while
    Dynamo traces it. It sits on the layers, not on the branches, so branches compiled on their own
    (:func:`compile_branches`) never trace it: their graphs and guards stay as they were. Eager forwards pay one
    call and one test per layer.
    """

    def __init__(self) -> None:
        self._once = Once(
            "dropbp: the branches run inside a larger torch.compile region (torch.compile(model), model.compile() "
            "or compiled layers). Gradients of kept branches are exact, but a weight in front of a dropped branch "
            "(the norm before a dropped MLP) gets a zero gradient instead of none, so AdamW or momentum still moves "
            "it, unlike eager DropBP. For exact DropBP compile the branches instead: "
            "dropbp.execution.compile_guards.compile_branches(ctl) (docs/scaling-out.md)",
            RuntimeWarning,
        )
        #: The modules the hook is on (for clean copies: :mod:`dropbp.execution.patching`).
        self.layers: list[nn.Module] = []

    def attach(self, model: nn.Module, branch_names: Sequence[str]) -> list[RemovableHandle]:
        """Register the hook on the module holding each branch (named as in ``model.named_modules()``)."""
        parents = dict.fromkeys(name.rpartition(".")[0] for name in branch_names)
        self.layers = [model.get_submodule(p) for p in parents]
        return [layer.register_forward_pre_hook(self, prepend=True) for layer in self.layers]

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling() and module.training and torch.is_grad_enabled():
            self._warn()

    @outside_graphs
    def _warn(self) -> None:
        self._once()
