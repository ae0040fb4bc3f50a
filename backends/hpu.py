"""Intel Gaudi (HPU) through the Gaudi PyTorch bridge ``habana_frameworks``: lazy or eager mode.

**Lazy mode** (``PT_HPU_LAZY_MODE=1``; the default before Gaudi software 1.21): ops accumulate into a
graph until ``htcore.mark_step()``, which compiles that graph (or fetches it from the cache) and runs
it. Hence:

- a graph break after ``loss.backward()`` and after ``optimizer.step()`` (and wherever the controller
  asks for one, :meth:`HPUBackend.graph_break`), as Habana's training recipes place them;
- every distinct drop pattern is a distinct forward+backward graph, and a distinct update graph too
  (parameters of dropped branches get no gradient), so unbounded random patterns would recompile
  without end. ``default_max_patterns = 16``: the graph cache stops growing after warm-up at no more
  than 16 forward+backward graphs and 16 update graphs. 16 because the common targets 0.5, 0.75 and
  0.875 are multiples of 1/16, so uniform rates at those targets are met exactly by the pattern pool.
- a dropped branch runs under ``torch.no_grad()`` (the core): its forward ops still enter the lazy
  graph, but no backward ops and no saved activations do; its temporaries are freed when the graph
  runs at the next break. Nothing more is needed.

**Eager mode** (``PT_HPU_LAZY_MODE=0``; the default from 1.21, used with ``torch.compile``): ops run
one by one from a per-op kernel cache, so a new drop pattern compiles nothing: no ``mark_step`` and no
pattern bound by default. Whoever ``torch.compile``-s the whole model compiles per pattern and
should pass ``max_patterns`` to ``dropbp.apply``.

The mode comes from ``habana_frameworks.torch.utils.internal.is_lazy()`` where the stack has it,
else from ``PT_HPU_LAZY_MODE`` (unset means lazy, as on the stacks before 1.21). Collectives use
``hccl`` (import ``habana_frameworks.torch.distributed.hccl`` before ``init_process_group``).
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
