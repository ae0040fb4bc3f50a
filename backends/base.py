"""The device interface: what the core needs from a device, and nothing about drop policy."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

__all__ = ["Backend", "BackendUnavailable"]


class BackendUnavailable(RuntimeError):
    """The requested device stack is missing; the message says what to install."""


class Backend(ABC):
    """One device family. Subclasses are small: they only answer device questions."""

    name: str = ""
    #: torch.distributed backend for this device (gloo / nccl / hccl / xccl).
    distributed_backend: str = "gloo"
    #: bound on distinct drop patterns where graphs are compiled per pattern; None: unbounded.
    default_max_patterns: int | None = None

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this device and its software stack can be used in this process."""

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    @abstractmethod
    def autocast_dtype(self) -> torch.dtype: ...

    def synchronize(self) -> None:
        """Wait until queued device work is done (before reading a clock)."""

    def memory_allocated(self) -> int:
        """Bytes held by tensors now; 0 where the device has no allocator statistics."""
        return 0

    def max_memory_allocated(self) -> int:
        """Peak bytes held by tensors since the last reset; 0 where unknown."""
        return 0

    def reset_peak_memory(self) -> None:
        """Start a new peak-memory window."""

    def after_backward(self) -> None:
        """Step boundary after ``loss.backward()`` (a graph break on lazy-mode devices)."""

    def after_optimizer_step(self) -> None:
        """Step boundary after ``optimizer.step()``."""

    def __repr__(self) -> str:
        return f"<dropbp backend {self.name!r} on {self.device}>"
