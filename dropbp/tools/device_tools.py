"""What the measurement tools ask of a device: a timer, the dtype and autocast benchmarks train in, an environment
report and the count of compiled graphs (``dropbp check``, ``bench``, ``membench``, the demo, the examples).

The execution never asks these, so they are not part of :class:`~dropbp.backends.Backend`. Each built-in device has
its answers here (:func:`tools_for`), composed from what its ``backends/<device>.py`` file reads of its own stack; a
device added as a plugin gets the defaults of :class:`DeviceTools` (or of the built-in it subclasses) and may
:func:`register` its own.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from dropbp import backends
from dropbp.backends import Backend

__all__ = ["DeviceTools", "EventTimer", "HostTimer", "register", "tools_for"]


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


class DeviceTools:
    """The tools' questions for one backend; the defaults suit any device (host clock, its autocast)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def timer(self) -> HostTimer | EventTimer:
        """A context manager whose ``.seconds`` is the time the block took on this device."""
        return HostTimer(self.backend.synchronize)

    @property
    def training_dtype(self) -> torch.dtype:
        """The dtype benchmarks train in by default: the autocast dtype on accelerators."""
        return self.backend.autocast_dtype

    def training_autocast(self) -> AbstractContextManager:
        """The context benchmarks run a training forward in: the backend's autocast on accelerators."""
        return self.backend.autocast()

    def environment(self) -> dict[str, object]:
        """Device name, device count and the device stack's versions, for reports (``dropbp check``).

        Bug reports from hardware this project cannot run on are only useful with these facts; nothing here may
        raise on a working device.
        """
        return {"device_name": self.backend.device.type, "device_count": None}

    def graph_compilations(self) -> int | None:
        """Graphs compiled so far where the device compiles graphs and reports it; None otherwise."""
        return None


class CPUTools(DeviceTools):
    @property
    def training_dtype(self) -> torch.dtype:
        """float32: bf16 matrix products are slower than float32 on most CPUs."""
        return torch.float32

    def training_autocast(self) -> AbstractContextManager:
        """No autocast: the CPU trains in float32 (see :attr:`training_dtype`)."""
        return nullcontext()

    def environment(self) -> dict[str, object]:
        """The CPU model, the cores PyTorch uses, and IPEX's version where it is installed."""
        return {
            "device_name": _cpu_name(),
            "device_count": 1,
            "cpu_threads": torch.get_num_threads(),
            **backends.cpu.stack_versions(),
        }


class CUDATools(DeviceTools):
    def timer(self) -> EventTimer:
        """CUDA events: timed on the GPU's stream, without stalling the host inside the block."""
        return EventTimer(torch.cuda)

    def environment(self) -> dict[str, object]:
        """GPU name and count, CUDA (or HIP) and cuDNN versions, and NCCL's where it is built in."""
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # no NCCL in this build (Windows, some ROCm builds): not an error for a report
            nccl = None
        return {
            "device_name": torch.cuda.get_device_name(),
            "device_count": torch.cuda.device_count(),
            "cuda": torch.version.cuda,
            "hip": getattr(torch.version, "hip", None),
            "cudnn": torch.backends.cudnn.version(),
            "nccl": nccl,
            "bf16_supported": torch.cuda.is_bf16_supported(),
        }


class XPUTools(DeviceTools):
    def timer(self) -> EventTimer:
        """XPU events: timed on the device's queue."""
        return EventTimer(torch.xpu)

    def environment(self) -> dict[str, object]:
        """Intel GPU name and count, and the SYCL/oneAPI version this PyTorch was built with."""
        return {
            "device_name": torch.xpu.get_device_name(),
            "device_count": torch.xpu.device_count(),
            "xpu": getattr(torch.version, "xpu", None),
        }


class HPUTools(DeviceTools):
    def environment(self) -> dict[str, object]:
        """Gaudi name and count, the bridge's version, lazy or eager mode and ``PT_HPU_LAZY_MODE``."""
        return backends.hpu.environment()

    def graph_compilations(self) -> int | None:
        """The bridge's ``graph_compilation`` metric, where its metrics API exists."""
        return backends.hpu.compiled_graphs()


class LazyEngineTools(DeviceTools):
    def environment(self) -> dict[str, object]:
        return {"device_name": "torch._lazy (TorchScript backend, CPU)", "device_count": 1, "mode": "lazy"}

    def graph_compilations(self) -> int | None:
        """The engine's own count of compiled graphs (this process)."""
        return backends.lazy.compiled_graphs()


_REGISTRY: dict[type[Backend], type[DeviceTools]] = {
    backends.cpu.CPUBackend: CPUTools,
    backends.cuda.CUDABackend: CUDATools,
    backends.xpu.XPUBackend: XPUTools,
    backends.hpu.HPUBackend: HPUTools,
    backends.lazy.LazyEngineBackend: LazyEngineTools,
}


def register(backend: type[Backend], tools: type[DeviceTools]) -> None:
    """Answer the tools' questions for ``backend`` (and its subclasses) with ``tools``: for a device plugin."""
    _REGISTRY[backend] = tools


def tools_for(backend: Backend) -> DeviceTools:
    """The tools' answers for ``backend``: those of its class, or of the nearest built-in class it derives from."""
    for cls in type(backend).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls](backend)
    return DeviceTools(backend)


def _cpu_name() -> str:
    """The CPU model (Linux's ``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
