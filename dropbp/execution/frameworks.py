"""Training frameworks that wrap the model or drive its optimizer, met by the core through one interface.

The core names no framework (DDP, torch's own, aside: :mod:`dropbp.execution.distributed`): each registers a
:class:`Framework`, declared in its package's entry points (group ``dropbp.frameworks``; dropbp's own,
:mod:`dropbp.integrations.deepspeed`, in pyproject.toml) and imported the first time the core consults the frameworks,
or by :func:`register`; the core asks every registered one to unwrap a model given to
``apply`` (:func:`unwrap`), to check such a wrapper (:func:`check_wrapper`), to guard a calibration closure
(:func:`calibration_closure`), and, at each training forward until one answers, for a step listener
(:class:`FrameworkWatch`): a framework may take hold of the model after ``apply`` (the Hugging Face Trainer
runs ``deepspeed.initialize`` in ``train()``). A framework whose package was never imported answers nothing,
at the cost of a dictionary look-up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from importlib.metadata import entry_points
from typing import Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dropbp.execution.hooks import StepListener

__all__ = [
    "Framework",
    "FrameworkWatch",
    "calibration_closure",
    "calibration_method",
    "check_wrapper",
    "register",
    "unwrap",
]


class Framework(Protocol):
    """What a framework tells the core; every method answers for this framework's objects only."""

    def unwrap(self, model: nn.Module) -> nn.Module | None:
        """The module ``model`` wraps, if ``model`` is this framework's wrapper; otherwise None."""

    def check_wrapper(self, wrapper: nn.Module, fill: str | None) -> None:
        """Raise ``ValueError``, saying what to change, if ``wrapper`` (one :meth:`unwrap` unwrapped) is set up
        in a way DropBP cannot train with, dropped branches' parameters getting the gradient ``fill`` (a feature's
        ``dropped_fill``; None: none)."""

    def step_listener(
        self, model: nn.Module, holders: Sequence[nn.Module], fill: Callable[[], str | None]
    ) -> StepListener | None:
        """A listener to the model's training forwards once this framework holds ``model`` (None: not yet).

        ``holders``: per branch, in branch order, one module holding all its parameters; ``fill()``: how dropped
        branches' parameters get a gradient now (None: they get none)."""

    def calibration_closure(self, closure: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """``closure``, stopped with advice where this framework cannot take calibration's passes."""

    def calibration_method(self, params: Sequence[nn.Parameter], method: str) -> str:
        """The calibration method to use for ``params`` where this framework holds them (else ``method``)."""


#: The entry-point group through which packages declare a :class:`Framework` (dropbp's own DeepSpeed integration
#: included, in pyproject.toml), loaded the first time the core consults the frameworks.
ENTRY_POINT_GROUP = "dropbp.frameworks"

_REGISTERED: list[Framework] = []
_declared_loaded = False


def register(framework: Framework) -> None:
    """Make the core consult ``framework`` (once, however often it is registered)."""
    if framework not in _registered():
        _REGISTERED.append(framework)


def _registered() -> list[Framework]:
    """Every registered framework, the declared ones (:data:`ENTRY_POINT_GROUP`) loaded on the first call."""
    global _declared_loaded
    if not _declared_loaded:  # marked loaded only once every declared one loaded: a failure says so at every call
        loaded = []
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                loaded.append(ep.load())
            except Exception as exc:  # a broken integration must say which, not fail somewhere later
                raise RuntimeError(
                    f"dropbp framework integration {ep.name!r} ({ep.value!r}) failed to import: "
                    f"{type(exc).__name__}: {exc}; reinstall the package that provides it"
                ) from exc
        _declared_loaded = True
        for framework in loaded:
            register(framework)
    return _REGISTERED


def unwrap(model: nn.Module) -> tuple[nn.Module, DistributedDataParallel | None]:
    """The module DropBP attaches to (a DDP wrapper's or a registered framework's wrapper's ``.module``) and
    the DDP wrapper, if any (:mod:`dropbp.execution.distributed` checks it)."""
    if isinstance(model, DistributedDataParallel):
        return model.module, model
    for framework in _registered():
        inner = framework.unwrap(model)
        if inner is not None:
            return inner, None
    return model, None


def check_wrapper(wrapper: nn.Module, fill: str | None) -> None:
    """Every registered framework's :meth:`Framework.check_wrapper` for a wrapper given to ``apply``."""
    for framework in _registered():
        if framework.unwrap(wrapper) is not None:
            framework.check_wrapper(wrapper, fill)


def calibration_closure(closure: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``closure`` guarded by every registered framework (:meth:`Framework.calibration_closure`)."""
    for framework in _registered():
        closure = framework.calibration_closure(closure)
    return closure


def calibration_method(params: Iterable[nn.Parameter], method: str) -> str:
    """``method`` as every registered framework would have it (:meth:`Framework.calibration_method`)."""
    params = list(params)
    for framework in _registered():
        method = framework.calibration_method(params, method)
    return method


class FrameworkWatch:
    """A step listener that asks the registered frameworks, at each training forward until one answers,
    for their own listener (:meth:`Framework.step_listener`), and passes every forward on to it.

    Args:
        model: the model DropBP is attached to.
        holders: per branch, in branch order, one module holding all its parameters.
        fill: how dropped branches' parameters get a gradient now (a feature's ``dropped_fill``; None: none).
    """

    def __init__(self, model: nn.Module, holders: Sequence[nn.Module], fill: Callable[[], str | None]) -> None:
        self._model = model
        self._holders = list(holders)
        self._fill = fill
        self._listener: StepListener | None = None

    def on_training_forward(self, pattern: frozenset[int]) -> None:
        if self._listener is None:
            found = (f.step_listener(self._model, self._holders, self._fill) for f in _registered())
            self._listener = next((listener for listener in found if listener is not None), None)
        if self._listener is not None:
            self._listener.on_training_forward(pattern)

    def on_remove(self) -> None:
        if self._listener is not None:
            self._listener.on_remove()
            self._listener = None
