"""Features: the capabilities beyond the paper's DropBP, each one object given to ``dropbp.apply(features=[...])``.

:class:`NoiseScale` measures the gradient noise scale (and chooses the rate of ``drop_rate="auto"``);
:class:`ChunkedLoss` computes a causal LM's head and loss in chunks. Each owns its options, its state, its Trainer log
and its removal, through the protocol of :mod:`dropbp.features.base`. Token drops, measured and not better, are a
feature of :mod:`dropbp.experimental`.
"""

from dropbp.features.base import Feature
from dropbp.features.chunked_loss import ChunkedLoss
from dropbp.features.noise_scale import NoiseScale

__all__ = ["ChunkedLoss", "Feature", "NoiseScale"]
