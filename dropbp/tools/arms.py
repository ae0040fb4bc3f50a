"""The measurement tools' arms as ``dropbp`` calls: one dict of settings per arm, as the results tables name them.

A tool's arm (``bench``, ``compare``, ``demo``, the memory probe) is a dict of settings: ``apply``'s options, the
experimental ones (:data:`dropbp.options.EXPERIMENTAL`) and the features' settings by the names the tables use
(``token_drop_rate`` / ``token_selection``, ``measure_noise_scale``, ``chunked_loss``). :func:`apply_arm` turns one into
the controller, each feature built from its settings; the product's own signature stays small.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dropbp import experimental
from dropbp.controller import DropBPController
from dropbp.experimental import TokenDrops
from dropbp.features import ChunkedLoss, Feature, NoiseScale

__all__ = ["apply_arm", "arm_features"]


def arm_features(settings: dict[str, Any]) -> tuple[dict[str, Any], list[Feature]]:
    """``settings`` without the features' settings, and the features they ask for."""
    rest = dict(settings)
    features: list[Feature] = list(rest.pop("features", ()))
    token_rate, selection = rest.pop("token_drop_rate", 0.0), rest.pop("token_selection", "gradient")
    if token_rate != 0:
        features.append(TokenDrops(token_rate, selection))
    if rest.pop("measure_noise_scale", False):
        features.append(NoiseScale())
    chunked = rest.pop("chunked_loss", False)
    if chunked is not False:
        features.append(ChunkedLoss(None if chunked is True else chunked))
    return rest, features


def apply_arm(model: nn.Module, drop_rate: float | str, **settings: Any) -> DropBPController:
    """``dropbp.experimental.apply`` for one arm's settings (see the module)."""
    rest, features = arm_features(settings)
    return experimental.apply(model, drop_rate, features=features, **rest)
