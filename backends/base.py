"""The device interface: what a training loop needs from a device, and nothing about drop policy.

Dropped branches need no per-device code: the core (``dropbp/no_grad.py``) runs them under
``torch.no_grad()``, so they record no autograd graph and their intermediate tensors are freed as soon
as the branch returns, on every device. What differs per device is listed here: where tensors live,
how to wait for queued work, memory figures, autocast, the collective library, and the step
boundaries a lazily compiled device needs (graph breaks) together with a bound on distinct drop
patterns where every pattern is its own compiled graph.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager

import torch
from torch import nn

from .timing import EventTimer, HostTimer

__all__ = ["Backend", "BackendUnavailable", "UnknownBackend", "describe"]


def describe(exc: BaseException) -> str:
    """``Type: first line of the message``: enough to say why a device stack failed, in one line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


class BackendUnavailable(RuntimeError):
    """The requested device or its software stack is missing; the one-line message says what to do."""


class UnknownBackend(BackendUnavailable, ValueError):
    """No backend has the requested name (also a ``ValueError``: the name itself is wrong)."""


class Backend(ABC):
    """One device family. Subclasses are small: they only answer device questions."""

    name: str = ""
    #: torch.distributed backend for this device (gloo / nccl / hccl / xccl).
    distributed_backend: str = "gloo"
    #: bound on distinct drop patterns where graphs are compiled per pattern; None: unbounded.
    default_max_patterns: int | None = None
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

    @property
    def training_dtype(self) -> torch.dtype:
        """The dtype benchmarks train in by default: the autocast dtype on accelerators."""
        return self.autocast_dtype

    def training_autocast(self) -> AbstractContextManager:
        """The context benchmarks run a training forward in: :meth:`autocast` on accelerators."""
        return self.autocast()

    def empty_cache(self) -> None:
        """Return cached allocator blocks to the device, between benchmark configurations only: in
        training it would cost re-allocation every step for nothing."""

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

    def synchronize(self) -> None:
        """Wait until queued device work is done (before reading a clock)."""

    def timer(self) -> HostTimer | EventTimer:
        """A context manager whose ``.seconds`` is the time the block took on this device."""
        return HostTimer(self.synchronize)

    def memory_allocated(self) -> int:
        """Bytes held by tensors now; 0 where the device has no allocator statistics."""
        return 0

    def max_memory_allocated(self) -> int:
        """Peak bytes held by tensors since the last reset; 0 where unknown."""
        return 0

    def reset_peak_memory(self) -> None:
        """Start a new peak-memory window."""

    def graph_compilations(self) -> int | None:
        """Graphs compiled so far where the device compiles graphs and reports it; None otherwise."""
        return None

    def graph_break(self) -> None:
        """Cut the pending lazy graph here (compile or fetch it, and run it); nothing on eager devices."""

    def after_backward(self) -> None:
        """Step boundary after ``loss.backward()``: the backward graph ends here on lazy devices."""
        self.graph_break()

    def after_optimizer_step(self) -> None:
        """Step boundary after ``optimizer.step()``: the update graph ends here on lazy devices."""
        self.graph_break()

    def environment(self) -> dict[str, object]:
        """Device name, device count and the device stack's versions, for reports (``dropbp check``).

        Bug reports from hardware this project cannot run on are only useful with these facts, so
        each backend states them in its own terms; nothing here may raise on a working device.
        """
        return {"device_name": self.device.type, "device_count": None}

    def __repr__(self) -> str:
        return f"<dropbp backend {self.name!r} on {self.device}>"
