"""PyTorch's own lazy-tensor engine (``torch._lazy``, TorchScript backend, CPU): Gaudi's lazy mode, runnable here.

:class:`LazyEngineBackend` is a :class:`~dropbp.backends.base.LazyGraphBackend`, as Gaudi's lazy mode is, with the
engine's touch points: :meth:`~LazyEngineBackend.mark_step` is ``torch._lazy.mark_step``, the device is ``"lazy"``, and
graphs are counted by the engine's own counters (:func:`compiled_graphs`, :func:`graph_runs`, per process: a measurement
that must not meet graphs compiled before it uses shapes of its own). Everything else (graph breaks, the pattern bound,
fixed token-row counts, ``ctl.backward`` / ``ctl.optimizer_step``) is the shared lazy-graph code. The engine has no
``torch.lazy`` device module, which ``torch.utils.checkpoint`` (the memory bound) looks up for the device of its inputs:
starting the engine registers a minimal one (:data:`DEVICE_MODULE`, as an out-of-tree device registers its own) that
reports no device generator, so a recomputation restores the CPU generator's state, the one the engine's random ops draw
from here. For measurement, tests and trying a Gaudi recipe without Gaudi (``DROPBP_BACKEND=lazy``); a real Gaudi run
uses the HPU backend. What it showed: docs/backends.md ("Gaudi lazy mode on a real lazy engine").
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
from dropbp.backends.base import LazyGraphBackend, describe

from dropbp.internals import register_device_module, torch_lazy

__all__ = ["DEVICE_MODULE", "LazyEngineBackend", "compiled_graphs", "graph_runs", "start"]

#: ``torch.lazy`` once the engine started: one device, no generator of its own (checkpointing then saves and restores
#: the CPU generator only).
DEVICE_MODULE = ModuleType("torch.lazy", "The lazy-tensor engine's device module, registered by dropbp.backends.lazy.")
DEVICE_MODULE.device_count = lambda: 1

_started = False


def start() -> None:
    """Start the engine with its TorchScript backend and register its device module (once per process)."""
    global _started
    if not _started:
        try:
            torch_lazy().ts_backend.init()
        except RuntimeError as error:  # started already, by the user (as PyTorch's docs do): it runs as it is
            if "multiple backend fallbacks" not in str(error):
                raise
        register_device_module("lazy", DEVICE_MODULE)
        _started = True


def _counter(name: str) -> int:
    return int(torch_lazy().metrics.counter_value(name) or 0)


def compiled_graphs() -> int:
    """Graphs compiled so far in this process (the engine's cache misses)."""
    return _counter("UncachedCompile")


def graph_runs() -> int:
    """Graphs run so far in this process: each ``mark_step`` with pending ops, and each value read early."""
    return _counter("UncachedCompile") + _counter("CachedCompile")


class LazyEngineBackend(LazyGraphBackend):
    """Gaudi's lazy mode on ``torch._lazy``."""

    name = "lazy"
    distributed_backend = "gloo"
    torch_module = None  # no torch.lazy: nothing to synchronize beyond the graph breaks, no allocator figures
    has_allocator_stats = False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            importlib.import_module("torch._lazy.ts_backend")
        except Exception as exc:
            return f"this PyTorch has no lazy-tensor engine with its TorchScript backend ({describe(exc)})"
        return None

    def __init__(self) -> None:
        start()
        super().__init__()

    def mark_step(self) -> None:
        torch_lazy().mark_step()

    @property
    def device(self) -> torch.device:
        return torch.device("lazy")

    @property
    def autocast_dtype(self) -> torch.dtype:
        return torch.float32  # the engine's TorchScript backend runs what the CPU runs; no lazy autocast

    def autocast(self) -> torch.autocast:
        return torch.autocast("cpu", enabled=False)

    def rng_state(self, device: torch.device) -> list[torch.Tensor]:
        return [torch.get_rng_state()]

    def __repr__(self) -> str:
        return "<dropbp backend 'lazy' (Gaudi's lazy mode on torch._lazy, TorchScript backend, CPU)>"
