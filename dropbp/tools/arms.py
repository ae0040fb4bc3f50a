"""The measurement tools' arms as ``dropbp`` calls: one dict of settings per arm, as the results tables name them.

A tool's arm (``bench``, ``compare``, ``demo``, the memory probe) is a dict of settings: ``apply``'s options and the
flat names the results tables use for the features (0.3's: ``unbiased``, ``dropped_grads``, ``drop_schedule`` /
``ramp``, ``stratify``, ``token_drop_rate`` / ``token_selection``, ``measure_noise_scale``, ``chunked_loss``), which
each registered feature reads itself (:meth:`dropbp.features.base.Feature.from_flat`: no list of them here), and
``seq_len`` (attention's FLOPs weighed at the tool's own length) and ``windows`` (the run's optimizer-step windows).
:func:`apply_arm` turns one into the controller; the product's own signature stays small.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

import dropbp.experimental  # noqa: F401  (registers the experimental features)
from dropbp.api import apply
from dropbp.controller import DropBPController
from dropbp.execution.discovery import flops_at_length
from dropbp.features.base import Feature, feature_classes
from dropbp.policy.windows import Windows

__all__ = ["apply_arm", "arm_features"]


def arm_features(settings: dict[str, Any]) -> tuple[dict[str, Any], list[Feature]]:
    """``settings`` without the features' flat names, and the features they ask for (after ``features`` given)."""
    rest = dict(settings)
    features: list[Feature] = list(rest.pop("features", ()))
    for cls in feature_classes().values():
        made = cls.from_flat(rest)
        if made is not None:
            features.append(made)
    return rest, features


def apply_arm(model: nn.Module, drop_rate: float | str, **settings: Any) -> DropBPController:
    """``dropbp.apply`` for one arm's settings (see the module)."""
    rest, features = arm_features(settings)
    windows = Windows.of(rest.pop("windows", None))
    with flops_at_length(rest.pop("seq_len")) if "seq_len" in rest else contextlib.nullcontext():
        ctl = apply(model, drop_rate, features=features, **rest)
    if windows is not None:
        ctl.windows = (windows.forwards_per_epoch, windows.accumulation)
    return ctl
