"""The device interface: what the execution of a dropped backward asks of a device, and nothing about drop policy.

A dropped branch runs under ``torch.no_grad()`` on every device (``dropbp/execution/branch_forward.py``); what differs
per device is listed here: where tensors live, how to wait for queued work, memory figures, autocast, the collective
library, the step boundaries and pattern bound of a lazily compiled device (:class:`LazyGraphBackend`), how the memory
bound recomputes kept branches (:meth:`Backend.checkpoint`) and restores random state (how experimental token drops
gather rows on each device is theirs: :mod:`dropbp.experimental.token_rows`). What only the measurement tools ask
(timers, environment reports, the dtype benchmarks train in, graph counts) is in :mod:`dropbp.tools.device_tools`.
Adding a device (its steps, built in or as a plugin): docs/backends.md, "Adding a device".
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["Backend", "BackendUnavailable", "LazyGraphBackend", "UnknownBackend", "describe"]

#: Distinct drop patterns a lazy-graph device compiles at most over a run (docs/backends.md says why 16).
LAZY_MAX_PATTERNS = 16


def describe(exc: BaseException) -> str:
    """``Type: first line of the message``: enough to say why a device stack failed, in one line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


class BackendUnavailable(RuntimeError):
    """The requested device or its software stack is missing; the one-line message says what to do."""


class UnknownBackend(BackendUnavailable, ValueError):
    """No backend has the requested name (also a ``ValueError``: the name itself is wrong)."""


class Backend(ABC):
    """One device family. Subclasses are small: they override what differs on their device, or say why nothing does."""

    name: str = ""
    #: torch.distributed backend for this device (gloo / nccl / hccl / xccl).
    distributed_backend: str = "gloo"
    #: bound on distinct drop patterns where graphs are compiled per pattern; None: unbounded.
    default_max_patterns: int | None = None
    #: the device's module in torch (``"cuda"`` for ``torch.cuda``, ``"xpu"``, ``"hpu"``), which answers
    #: :meth:`synchronize` and, with :attr:`has_allocator_stats`, the memory figures under the same names on
    #: every device; None: nothing to wait for (the CPU).
    torch_module: str | None = None
    #: whether the device's allocator reports peak memory (:meth:`max_memory_allocated`); where it does
    #: not (the CPU), peak memory is the process's resident set, measured in a fresh process.
    has_allocator_stats: bool = False

    @classmethod
    @abstractmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run in this process (what is missing, how to install it); None if it can.

        Device stacks are imported here, lazily, never when ``dropbp.backends`` is imported.
        """

    @classmethod
    def is_available(cls) -> bool:
        """Whether this device and its software stack can be used in this process."""
        return cls.unavailable_reason() is None

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    @abstractmethod
    def autocast_dtype(self) -> torch.dtype: ...

    def autocast(self) -> torch.autocast:
        """Mixed-precision context for the forward pass on this device."""
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """Put ``model`` on this device, with any device-specific optimisation; call before ``dropbp.apply``.

        The optimizer stays valid: ``Module.to`` moves parameters in place.
        """
        return model.to(self.device), optimizer

    def init_distributed(self) -> int:
        """Join the job ``torchrun`` started: this process's device, then ``init_process_group`` with
        :attr:`distributed_backend`; returns the rank. Call first (before building the model)."""
        self._use_local_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(self.distributed_backend)
        return torch.distributed.get_rank()

    def _use_local_device(self, local_rank: int) -> None:
        """Make device ``local_rank`` this process's device, where a host has several per process group."""

    def _module(self) -> ModuleType | None:
        """``torch.<torch_module>``, looked up per call (a stand-in installed by a test is found)."""
        return None if self.torch_module is None else getattr(torch, self.torch_module)

    def synchronize(self) -> None:
        """Wait until queued device work is done (before reading a clock)."""
        module = self._module()
        if module is not None:
            module.synchronize()

    def _allocator(self) -> ModuleType | None:
        return self._module() if self.has_allocator_stats else None

    def max_memory_allocated(self) -> int:
        """Peak bytes held by tensors since the last reset; 0 where unknown."""
        allocator = self._allocator()
        return 0 if allocator is None else allocator.max_memory_allocated()

    def reset_peak_memory(self) -> None:
        """Start a new peak-memory window."""
        allocator = self._allocator()
        if allocator is not None:
            allocator.reset_peak_memory_stats()

    def graph_break(self) -> None:
        """Cut the pending lazy graph here (compile or fetch it, and run it); nothing on eager devices."""

    def after_backward(self) -> None:
        """Step boundary after ``loss.backward()``: the backward graph ends here on lazy devices."""
        self.graph_break()

    def after_optimizer_step(self) -> None:
        """Step boundary after ``optimizer.step()``: the update graph ends here on lazy devices."""
        self.graph_break()

    # -- the device's part of a dropped backward ---------------------------------------------------
    def checkpoint(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` with its activations recomputed in backward (the memory bound's layers):
        non-re-entrant ``torch.utils.checkpoint``, which restores this device's random-number state."""
        return checkpoint(function, *args, use_reentrant=False, **kwargs)

    def rng_state(self, device: torch.device) -> list[torch.Tensor]:
        """The generator states a branch on ``device`` draws from: the CPU's and, on an accelerator, that device's.
        A dropped branch's recomputation is skipped only where it would draw the same numbers again."""
        states = [torch.get_rng_state()]
        if device.type not in ("cpu", "meta"):
            states.append(torch.get_device_module(device).get_rng_state(device))
        return states

    def set_rng_state(self, device: torch.device, states: list[torch.Tensor]) -> None:
        """Put back what :meth:`rng_state` returned for ``device``."""
        torch.set_rng_state(states[0])
        if len(states) > 1:
            torch.get_device_module(device).set_rng_state(states[1], device)

    def collective_device(self, device: torch.device) -> torch.device:
        """Where a tensor for a collective goes (calibration averages over ranks): the CPU under ``gloo``,
        else ``device``."""
        return torch.device("cpu") if torch.distributed.get_backend() == "gloo" else device

    def __repr__(self) -> str:
        return f"<dropbp backend {self.name!r} on {self.device}>"


class LazyGraphBackend(Backend):
    """A device that records operations into graphs and compiles each distinct graph (Gaudi's lazy mode, the lazy
    engine): a graph break after backward and after the optimizer step, a bound of :data:`LAZY_MAX_PATTERNS` distinct
    drop patterns held over the whole run (token drops' fixed row counts: :mod:`dropbp.experimental.token_rows`).
    Subclasses say how to cut a graph (:meth:`mark_step`) and whether the device runs lazily now (:attr:`lazy`)."""

    #: True where graphs are recorded and cut by :meth:`mark_step`; False (an eager mode): nothing of the above.
    lazy: bool = True

    def __init__(self) -> None:
        self.default_max_patterns = LAZY_MAX_PATTERNS if self.lazy else None

    @abstractmethod
    def mark_step(self) -> None:
        """Cut the pending lazy graph: compile it (or fetch it from the cache) and run it."""

    def graph_break(self) -> None:
        if self.lazy:
            self.mark_step()
