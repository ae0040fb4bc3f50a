"""What the measurement tools ask of a device beyond training: a timer, an environment report, the dtype
benchmarks train in, and the count of compiled graphs.

A :class:`~dropbp.backends.Backend` answers what a training loop needs (device, step boundaries, memory
figures, autocast, collectives); these questions come only from ``dropbp check``, ``bench``, ``membench``,
``demo`` and the examples' reports, so they live beside the tools. ``services(backend)`` gives the
services for a backend's class (a subclass gets its base's), else the generic ones, which is what a
plugin backend gets. Device stacks are imported here only when a report asks for their versions.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
from contextlib import AbstractContextManager, nullcontext

import torch

from ..backends import Backend
from ..backends.cpu import CPUBackend, installed_ipex_version
from ..backends.cuda import CUDABackend
from ..backends.hpu import HPUBackend
from ..backends.xpu import XPUBackend
from .timing import EventTimer, HostTimer

__all__ = ["DeviceServices", "register", "services"]


class DeviceServices:
    """The generic answers: host-clock timing, the autocast dtype, a minimal report, no graph count."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    @property
    def training_dtype(self) -> torch.dtype:
        """The dtype benchmarks train in by default: the autocast dtype on accelerators."""
        return self.backend.autocast_dtype

    def training_autocast(self) -> AbstractContextManager:
        """The context benchmarks run a training forward in: the backend's autocast on accelerators."""
        return self.backend.autocast()

    def timer(self) -> HostTimer | EventTimer:
        """A context manager whose ``.seconds`` is the time the block took on this device."""
        return HostTimer(self.backend.synchronize)

    def environment(self) -> dict[str, object]:
        """Device name, device count and the device stack's versions, for reports (``dropbp check``).

        Bug reports from hardware this project cannot run on are only useful with these facts, so
        each device states them in its own terms; nothing here may raise on a working device.
        """
        return {"device_name": self.backend.device.type, "device_count": None}

    def graph_compilations(self) -> int | None:
        """Graphs compiled so far where the device compiles graphs and reports it; None otherwise."""
        return None


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


class _CPUServices(DeviceServices):
    @property
    def training_dtype(self) -> torch.dtype:
        """float32: bf16 matrix products are slower than float32 on most CPUs."""
        return torch.float32

    def training_autocast(self) -> AbstractContextManager:
        """No autocast: the CPU trains in float32 (see :attr:`training_dtype`)."""
        return nullcontext()

    def environment(self) -> dict[str, object]:
        """Cores PyTorch uses, and IPEX's version when it is installed (used only when it matches torch)."""
        return {
            "device_name": _cpu_name(),
            "device_count": 1,
            "cpu_threads": torch.get_num_threads(),
            "intel_extension_for_pytorch": installed_ipex_version(),
        }


class _CUDAServices(DeviceServices):
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


class _XPUServices(DeviceServices):
    def timer(self) -> EventTimer:
        return EventTimer(torch.xpu)

    def environment(self) -> dict[str, object]:
        """Intel GPU name and count, and the SYCL/oneAPI version this PyTorch was built with."""
        return {
            "device_name": torch.xpu.get_device_name(),
            "device_count": torch.xpu.device_count(),
            "xpu": getattr(torch.version, "xpu", None),
        }


def _bridge_version() -> str | None:
    """The Gaudi PyTorch bridge's version: its distribution's metadata, else the module's attribute."""
    try:
        return importlib.metadata.version("habana-torch-plugin")
    except importlib.metadata.PackageNotFoundError:
        return getattr(importlib.import_module("habana_frameworks.torch"), "__version__", None)


class _HPUServices(DeviceServices):
    backend: HPUBackend

    def environment(self) -> dict[str, object]:
        """Gaudi name and count, the bridge's version, lazy or eager mode and ``PT_HPU_LAZY_MODE``."""
        hpu = importlib.import_module("habana_frameworks.torch.hpu")
        name = getattr(hpu, "get_device_name", None)
        return {
            "device_name": name() if callable(name) else "Gaudi",
            "device_count": int(hpu.device_count()),
            "habana_frameworks": _bridge_version(),
            "mode": "lazy" if self.backend.lazy else "eager",
            "PT_HPU_LAZY_MODE": os.environ.get("PT_HPU_LAZY_MODE"),
        }

    def graph_compilations(self) -> int | None:
        """``metric_global("graph_compilation")``'s TotalNumber, where the metrics API exists."""
        try:
            metrics = importlib.import_module("habana_frameworks.torch.hpu.metrics")
        except ImportError:
            return None
        return int(dict(metrics.metric_global("graph_compilation").stats())["TotalNumber"])


_BY_BACKEND: dict[type[Backend], type[DeviceServices]] = {}


def register(backend: type[Backend], answers: type[DeviceServices]) -> None:
    """Give the tools ``answers`` (a :class:`DeviceServices` subclass) for ``backend`` and its subclasses: the
    tools side of a device, registered beside its backend (a plugin calls this from its own module)."""
    if not (isinstance(answers, type) and issubclass(answers, DeviceServices)):
        raise TypeError(f"register() takes a DeviceServices subclass for {backend.__name__}, got {answers!r}")
    _BY_BACKEND[backend] = answers


for _backend, _answers in (
    (CPUBackend, _CPUServices),
    (CUDABackend, _CUDAServices),
    (HPUBackend, _HPUServices),
    (XPUBackend, _XPUServices),
):
    register(_backend, _answers)


def services(backend: Backend) -> DeviceServices:
    """The tools' services for ``backend``: those of its class or nearest base class, else the generic ones."""
    found = next((_BY_BACKEND[c] for c in type(backend).__mro__ if c in _BY_BACKEND), DeviceServices)
    return found(backend)
