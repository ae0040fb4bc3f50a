"""dropbp: cheaper fine-tuning steps (faster, fewer activations) by dropping the backward pass of random residual
branches.

What users call: ``dropbp.apply(model, drop_rate)`` (attaches DropBP to a Hugging Face or custom model and returns the
:class:`DropBPController`), its options (:class:`DropBPOptions`; the Trainer's, :class:`TrainerOptions`), the
features it takes (:class:`NoiseScale`, :class:`ChunkedLoss`; :mod:`dropbp.experimental` holds what was measured and
is not better),
``dropbp.allocate_rates`` (sensitivity-based rates), the device backends (``dropbp.backends``) and, for the Hugging
Face Trainer, ``dropbp.attach`` / ``dropbp.DropBPCallback`` (imported from :mod:`dropbp.integrations.hf` when first
used: ``import dropbp`` imports no integration and no optional package). The tree: the drop policy
(:mod:`dropbp.policy`), the execution of a dropped backward (:mod:`dropbp.execution`), one file per device
(:mod:`dropbp.backends`), the controller; the features (:mod:`dropbp.features`) and :mod:`dropbp.experimental` beside
it; integrations and tools on top.
"""

from __future__ import annotations

from typing import Any

from dropbp import backends, experimental
from dropbp.api import apply
from dropbp.architectures import SUPPORTED_ARCHITECTURES
from dropbp.controller import DropBPController
from dropbp.execution.discovery import Branch
from dropbp.features import ChunkedLoss, Feature, NoiseScale
from dropbp.options import DropBPOptions, TrainerOptions
from dropbp.policy.allocation import allocate_rates

__version__ = "0.4.0"

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "Branch",
    "ChunkedLoss",
    "DropBPCallback",
    "DropBPController",
    "DropBPOptions",
    "Feature",
    "NoiseScale",
    "TrainerOptions",
    "__version__",
    "allocate_rates",
    "apply",
    "attach",
    "backends",
    "experimental",
]

#: Names served by the Hugging Face integration, imported on first use (it needs transformers).
_HF_NAMES = ("attach", "DropBPCallback")


def __getattr__(name: str) -> Any:
    if name in _HF_NAMES:
        from dropbp.integrations import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'dropbp' has no attribute {name!r}")
