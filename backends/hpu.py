"""Intel Gaudi (HPU) through the Gaudi PyTorch bridge ``habana_frameworks``: lazy or eager mode.

Lazy mode (``PT_HPU_LAZY_MODE=1``, the default before Gaudi software 1.21) is a
:class:`~dropbp.backends.base.LazyGraphBackend`: a graph break (``htcore.mark_step()``) after backward and after the
optimizer step, ``default_max_patterns = 16`` (every distinct pattern is its own compiled graph) and token drops on
fixed row counts. Eager mode (the default from 1.21): none of these. The mode comes from
``habana_frameworks.torch.utils.internal.is_lazy()`` where the stack has it, else ``PT_HPU_LAZY_MODE`` (unset: lazy).
Collectives use ``hccl``. Why and what to expect (graph counts, a runbook): docs/backends.md.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os

import torch
from dropbp.backends.base import LazyGraphBackend, describe

_INSTALL = (
    "install Intel Gaudi software with Intel's installer or use the Gaudi PyTorch container "
    "(https://docs.habana.ai/en/latest/Installation_Guide/); it is not on PyPI"
)


def _lazy_mode() -> bool:
    try:
        internal = importlib.import_module("habana_frameworks.torch.utils.internal")
    except ImportError:
        return os.environ.get("PT_HPU_LAZY_MODE", "1").strip() != "0"
    return bool(internal.is_lazy())


class HPUBackend(LazyGraphBackend):
    name = "hpu"
    distributed_backend = "hccl"
    torch_module = "hpu"  # its synchronize waits for launched graphs: in lazy mode, those before the last break
    has_allocator_stats = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            hpu = importlib.import_module("habana_frameworks.torch.hpu")
            importlib.import_module("habana_frameworks.torch.core")
        except Exception as exc:  # a broken stack fails with OSError/RuntimeError too, not only ImportError
            return (
                "the Intel Gaudi PyTorch bridge (habana_frameworks.torch) cannot be imported "
                f"({describe(exc)}); {_INSTALL}"
            )
        if not hpu.is_available():
            return (
                "habana_frameworks is installed but sees no Gaudi device "
                "(habana_frameworks.torch.hpu.is_available() is False); check the habanalabs driver (hl-smi)"
            )
        return None

    def __init__(self) -> None:
        self.lazy = _lazy_mode()  # lazy mode: graphs cut by mark_step; eager/compile mode: none of LazyGraphBackend's
        super().__init__()

    def mark_step(self) -> None:
        """Cut the pending lazy graph: ``habana_frameworks.torch.core.mark_step()``."""
        importlib.import_module("habana_frameworks.torch.core").mark_step()

    @property
    def device(self) -> torch.device:
        return torch.device("hpu")

    def init_distributed(self) -> int:
        """Registers the ``hccl`` collective backend (an import) before joining the job."""
        importlib.import_module("habana_frameworks.torch.distributed.hccl")
        return super().init_distributed()

    @property
    def autocast_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def __repr__(self) -> str:
        return f"<dropbp backend 'hpu' ({'lazy' if self.lazy else 'eager'} mode) on {self.device}>"


def _bridge_version() -> str | None:
    """The Gaudi PyTorch bridge's version: its distribution's metadata, else the module's attribute."""
    try:
        return importlib.metadata.version("habana-torch-plugin")
    except importlib.metadata.PackageNotFoundError:
        return getattr(importlib.import_module("habana_frameworks.torch"), "__version__", None)


def environment() -> dict[str, object]:
    """Gaudi name and count, the bridge's version, lazy or eager mode and ``PT_HPU_LAZY_MODE`` (for reports)."""
    hpu = importlib.import_module("habana_frameworks.torch.hpu")
    name = getattr(hpu, "get_device_name", None)
    return {
        "device_name": name() if callable(name) else "Gaudi",
        "device_count": int(hpu.device_count()),
        "habana_frameworks": _bridge_version(),
        "mode": "lazy" if _lazy_mode() else "eager",
        "PT_HPU_LAZY_MODE": os.environ.get("PT_HPU_LAZY_MODE"),
    }


def compiled_graphs() -> int | None:
    """Graphs compiled so far (``metric_global("graph_compilation")``'s TotalNumber), where the metrics API exists."""
    try:
        metrics = importlib.import_module("habana_frameworks.torch.hpu.metrics")
    except ImportError:
        return None
    return int(dict(metrics.metric_global("graph_compilation").stats())["TotalNumber"])
