"""The device interface: what a training loop needs from a device, and nothing about drop policy.

Dropped branches need no per-device code: the core (``dropbp/no_grad.py``) runs them under
``torch.no_grad()``, so they record no autograd graph and their intermediate tensors are freed as soon
as the branch returns, on every device. What differs per device is listed here: where tensors live,
how to wait for queued work, memory figures, autocast, the collective library, and the step
boundaries a lazily compiled device needs (graph breaks) together with a bound on distinct drop
patterns where every pattern is its own compiled graph. What only the measurement tools ask (timers,
environment reports, the dtype benchmarks train in, graph counts) is in ``dropbp/tools/device_services.py``.
Adding a device (its steps, built in or as a plugin): docs/backends.md, "Adding a device".
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from types import ModuleType

import torch
from torch import nn

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

    def memory_allocated(self) -> int:
        """Bytes held by tensors now; 0 where the device has no allocator statistics."""
        allocator = self._allocator()
        return 0 if allocator is None else allocator.memory_allocated()

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

    def __repr__(self) -> str:
        return f"<dropbp backend {self.name!r} on {self.device}>"
