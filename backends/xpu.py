"""XPU (Intel GPUs) through upstream ``torch.xpu`` (PyTorch >= 2.5); no IPEX: its development stopped.

Eager kernels, like CUDA: no pattern bound, no graph breaks, and a dropped branch's temporaries go
back to the XPU caching allocator when it returns (the core runs it under ``torch.no_grad()``).
Collectives use ``xccl`` (upstream since PyTorch 2.7).
"""

from __future__ import annotations

import torch
from dropbp.backends.base import Backend

from dropbp.internals import built_with

_INSTALL = (
    "install the XPU build of PyTorch (pip install torch --index-url https://download.pytorch.org/whl/xpu) "
    "and the Intel GPU driver"
)


class XPUBackend(Backend):
    """The execution's defaults hold on Intel GPUs, as on CUDA (checkpointing, the device generator, any row count)."""

    name = "xpu"
    distributed_backend = "xccl"
    torch_module = "xpu"
    has_allocator_stats = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        xpu = getattr(torch, "xpu", None)
        if xpu is None:
            return f"this PyTorch ({torch.__version__}) has no torch.xpu; {_INSTALL}"
        if not built_with("xpu"):
            return f"this PyTorch ({torch.__version__}) was built without XPU support; {_INSTALL}"
        if not xpu.is_available():
            return (
                f"PyTorch {torch.__version__} has XPU support but sees no Intel GPU "
                "(torch.xpu.is_available() is False); check the Intel GPU driver (xpu-smi)"
            )
        return None

    @property
    def device(self) -> torch.device:
        return torch.device("xpu", torch.xpu.current_device())

    def _use_local_device(self, local_rank: int) -> None:
        torch.xpu.set_device(local_rank)

    @property
    def autocast_dtype(self) -> torch.dtype:
        return torch.bfloat16
