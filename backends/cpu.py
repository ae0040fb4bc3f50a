"""CPU: plain PyTorch, bf16 autocast, gloo. Nothing to break, nothing to compile per pattern."""

from __future__ import annotations

import torch

from .base import Backend


class CPUBackend(Backend):
    name = "cpu"
    distributed_backend = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def autocast_dtype(self) -> torch.dtype:
        return torch.bfloat16
