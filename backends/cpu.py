"""CPU: plain PyTorch or, when it fits the installed torch, Intel Extension for PyTorch; bf16; gloo.

Nothing is compiled per drop pattern and nothing needs a graph break. A dropped branch runs under
``torch.no_grad()`` (the core) and its intermediate tensors return to the allocator when it ends;
there is no device cache to manage.

IPEX pins one torch minor version per release and, imported next to any other torch, prints an
error and ends the process; its development stopped after 2.8. So its version is read from the
package metadata *before* it is imported, and it is used only on an exact major.minor match.
Otherwise the backend stays on plain PyTorch and says so in one log line.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import sys
from types import ModuleType

import torch
from dropbp.backends.base import Backend, describe
from torch import nn

logger = logging.getLogger("dropbp")

_IPEX = "intel_extension_for_pytorch"


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def installed_ipex_version() -> str | None:
    """IPEX's version without importing it (an already imported module answers for itself); also for reports."""
    if _IPEX in sys.modules:
        module = sys.modules[_IPEX]
        return None if module is None else str(getattr(module, "__version__", "unknown"))
    try:
        return importlib.metadata.version(_IPEX)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def ipex() -> ModuleType | None:
    """The IPEX module when it is installed and matches torch; else None. Logs the outcome once."""
    version = installed_ipex_version()
    if version is None:
        logger.info("cpu backend: %s is not installed; using plain PyTorch", _IPEX)
        return None
    if _major_minor(version) != _major_minor(torch.__version__):
        logger.warning(
            "cpu backend: %s %s does not match torch %s (needs the same major.minor); using plain PyTorch",
            _IPEX,
            version,
            torch.__version__,
        )
        return None
    try:
        module = importlib.import_module(_IPEX)
    except Exception as exc:  # a broken install must not stop CPU training: fall back, say why
        logger.warning(
            "cpu backend: %s %s failed to import (%s); using plain PyTorch", _IPEX, version, describe(exc)
        )
        return None
    logger.info("cpu backend: using %s %s (ipex.optimize)", _IPEX, version)
    return module


class CPUBackend(Backend):
    """Overrides :meth:`prepare` (IPEX); the execution's defaults (checkpointing, CPU random state) are the CPU's."""

    name = "cpu"
    distributed_backend = "gloo"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def autocast_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """``ipex.optimize`` (bf16) when IPEX fits this torch; plain PyTorch otherwise.

        IPEX optimizes a model in training mode together with its optimizer (bf16 weights, fp32 master
        weights in the optimizer), or a model in eval mode alone, and asserts on any other pair;
        ``dropbp check`` prepares a training model alone. Such a pair stays on plain PyTorch, with one
        log line. An optimized model runs its forward under :meth:`autocast`: oneDNN has no float32
        kernel for its bf16 linear layers.
        """
        model, optimizer = super().prepare(model, optimizer)
        module = ipex()
        if module is None:
            return model, optimizer
        if model.training != (optimizer is not None):
            mode, given = ("training", "without") if model.training else ("eval", "with")
            logger.warning(
                "cpu backend: ipex.optimize takes a model in training mode with its optimizer, or one in eval mode "
                "without; got one in %s mode %s an optimizer, so it stays on plain PyTorch",
                mode,
                given,
            )
            return model, optimizer
        if optimizer is None:
            return module.optimize(model, dtype=self.autocast_dtype), None
        return module.optimize(model, optimizer=optimizer, dtype=self.autocast_dtype)


def stack_versions() -> dict[str, object]:
    """The version of IPEX where it is installed (for reports; it is used only where it matches torch)."""
    return {_IPEX: installed_ipex_version()}
