"""Intel Gaudi (HPU) through the Gaudi PyTorch bridge ``habana_frameworks``: lazy or eager mode.

Lazy mode (``PT_HPU_LAZY_MODE=1``, the default before Gaudi software 1.21): a graph break
(``htcore.mark_step()``) after backward and after the optimizer step, and ``default_max_patterns = 16``
(every distinct pattern is its own compiled graph). Eager mode (the default from 1.21): neither. The mode comes
from ``habana_frameworks.torch.utils.internal.is_lazy()`` where the stack has it, else ``PT_HPU_LAZY_MODE``
(unset: lazy). Collectives use ``hccl``. Why and what to expect (graph counts, a runbook): docs/backends.md.
"""

from __future__ import annotations

import importlib
import os

import torch

from .base import Backend, describe

#: Pattern bound in lazy mode (see the module docstring for why 16).
LAZY_MAX_PATTERNS = 16

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


class HPUBackend(Backend):
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
        self._htcore = importlib.import_module("habana_frameworks.torch.core")
        #: True in lazy mode (graphs cut by mark_step), False in eager/compile mode.
        self.lazy = _lazy_mode()
        self.default_max_patterns = LAZY_MAX_PATTERNS if self.lazy else None

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

    def graph_break(self) -> None:
        if self.lazy:
            self._htcore.mark_step()

    def __repr__(self) -> str:
        return f"<dropbp backend 'hpu' ({'lazy' if self.lazy else 'eager'} mode) on {self.device}>"
