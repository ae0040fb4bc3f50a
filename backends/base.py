"""The device interface: what a training loop needs from a device, and nothing about drop policy.

Dropped branches need no per-device code: the core (``dropbp/execution/branch_forward.py``) runs them under
``torch.no_grad()``, so they record no autograd graph and their intermediate tensors are freed as soon
as the branch returns, on every device. What differs per device is listed here: where tensors live,
how to wait for queued work, memory figures, autocast, the collective library, and the step
boundaries a lazily compiled device needs (graph breaks) together with a bound on distinct drop
patterns where every pattern is its own compiled graph. What only the measurement tools ask (timers,
environment reports, the dtype benchmarks train in, graph counts) is in ``backends/<device>.py``.
Adding a device (its steps, built in or as a plugin): docs/backends.md, "Adding a device".
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["Backend", "BackendUnavailable", "EventTimer", "HostTimer", "UnknownBackend", "describe"]


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

    # -- what the tools ask (dropbp check, bench, membench, demo) ----------------------------------
    @property
    def training_dtype(self) -> torch.dtype:
        """The dtype benchmarks train in by default: the autocast dtype on accelerators."""
        return self.autocast_dtype

    def training_autocast(self) -> AbstractContextManager:
        """The context benchmarks run a training forward in: :meth:`autocast` on accelerators."""
        return self.autocast()

    def timer(self) -> HostTimer | EventTimer:
        """A context manager whose ``.seconds`` is the time the block took on this device."""
        return HostTimer(self.synchronize)

    def environment(self) -> dict[str, object]:
        """Device name, device count and the device stack's versions, for reports (``dropbp check``).

        Bug reports from hardware this project cannot run on are only useful with these facts, so each device
        states them in its own terms; nothing here may raise on a working device.
        """
        return {"device_name": self.device.type, "device_count": None}

    def graph_compilations(self) -> int | None:
        """Graphs compiled so far where the device compiles graphs and reports it; None otherwise."""
        return None

    def __repr__(self) -> str:
        return f"<dropbp backend {self.name!r} on {self.device}>"


class HostTimer:
    """Wall-clock timing of a block: waits for the device on entry and exit, then reads the host clock."""

    def __init__(self, synchronize: Callable[[], None]) -> None:
        self._synchronize = synchronize
        self._start = self._end = 0.0

    def __enter__(self) -> HostTimer:
        self._synchronize()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._synchronize()
        self._end = time.perf_counter()

    @property
    def seconds(self) -> float:
        return self._end - self._start


class EventTimer:
    """Device-side timing with the device's events (``torch.cuda.Event``, ``torch.xpu.Event``).

    Events are recorded in the device's stream, so the block is not serialised with the host; only
    reading :attr:`seconds` waits for the end event.
    """

    def __init__(self, device_module: Any) -> None:
        self._start = device_module.Event(enable_timing=True)
        self._end = device_module.Event(enable_timing=True)

    def __enter__(self) -> EventTimer:
        self._start.record()
        return self

    def __exit__(self, *exc: object) -> None:
        self._end.record()

    @property
    def seconds(self) -> float:
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1000.0

