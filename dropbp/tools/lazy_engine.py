"""The HPU backend's lazy mode on PyTorch's own lazy-tensor engine (``torch._lazy``), on the CPU.

:class:`LazyEngineBackend` is :class:`~backends.hpu.HPUBackend` in lazy mode with only its two touch points on
Habana's stack moved: ``mark_step`` is ``torch._lazy.mark_step`` and the device is ``"lazy"``; everything else
(graph breaks, the pattern bound, ``ctl.backward`` / ``ctl.optimizer_step``) is the HPU backend's own code.
:func:`compiled_graphs` (cache misses) and :func:`graph_runs` (misses and hits) read the engine's counters, which are
per process (the cache lives as long as the process): a measurement that must not meet graphs compiled before it uses
shapes of its own. For measurement and tests only; a real Gaudi run uses :class:`~backends.hpu.HPUBackend`
unchanged. The engine, and what it showed: docs/backends.md ("Gaudi lazy mode on a real lazy engine").
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ..backends.hpu import LAZY_MAX_PATTERNS, HPUBackend
from ..internals import torch_lazy

__all__ = ["LazyEngineBackend", "compiled_graphs", "graph_runs", "start"]

_started = False


def start() -> None:
    """Start the engine with its TorchScript backend (once per process)."""
    global _started
    if not _started:
        torch_lazy().ts_backend.init()
        _started = True


def _counter(name: str) -> int:
    return int(torch_lazy().metrics.counter_value(name) or 0)


def compiled_graphs() -> int:
    """Graphs compiled so far in this process (the engine's cache misses)."""
    return _counter("UncachedCompile")


def graph_runs() -> int:
    """Graphs run so far in this process: each ``mark_step`` with pending ops, and each value read early."""
    return _counter("UncachedCompile") + _counter("CachedCompile")


class LazyEngineBackend(HPUBackend):
    """The HPU backend in lazy mode, its ``mark_step`` and device on ``torch._lazy``."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    def __init__(self) -> None:
        start()
        self._htcore = SimpleNamespace(mark_step=torch_lazy().mark_step)
        self.lazy = True
        self.default_max_patterns = LAZY_MAX_PATTERNS

    @property
    def device(self) -> torch.device:
        return torch.device("lazy")

    def __repr__(self) -> str:
        return "<dropbp backend 'hpu' (lazy mode) on torch._lazy (TorchScript backend, CPU)>"
