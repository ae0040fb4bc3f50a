"""CUDA (NVIDIA; ROCm builds answer to the same ``torch.cuda`` API): nccl, caching-allocator figures.

Eager kernels: nothing is compiled per drop pattern, so no pattern bound and no graph breaks. A dropped
branch runs under ``torch.no_grad()`` (the core), so it saves no activations; its temporaries go back
to PyTorch's caching allocator when the branch returns and are reused by the next allocations. The
backend deliberately does not call ``torch.cuda.empty_cache()``: returning blocks to the driver
would synchronise the device every step and the memory would only be requested again.
"""

from __future__ import annotations

import torch
from dropbp.backends.base import Backend

_INSTALL = "install a CUDA build of PyTorch (https://pytorch.org/get-started/locally/)"


class CUDABackend(Backend):
    """The execution's defaults hold on CUDA (non-re-entrant checkpointing, the device generator, any row count)."""

    name = "cuda"
    distributed_backend = "nccl"
    torch_module = "cuda"
    has_allocator_stats = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not torch.backends.cuda.is_built():
            return f"this PyTorch ({torch.__version__}) was built without CUDA; {_INSTALL}"
        if not torch.cuda.is_available():
            return (
                f"PyTorch {torch.__version__} has CUDA support but sees no GPU "
                "(torch.cuda.is_available() is False); check the NVIDIA driver (nvidia-smi) and "
                "CUDA_VISIBLE_DEVICES"
            )
        return None

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def _use_local_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank)

    @property
    def autocast_dtype(self) -> torch.dtype:
        """bf16 where the GPU has it (Ampere and later), else fp16."""
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
