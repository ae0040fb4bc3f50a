"""dropbp: faster, lighter fine-tuning by dropping the backward pass of random residual branches.

``dropbp.apply(model, drop_rate)`` attaches DropBP to a Hugging Face or custom model;
``dropbp.allocate_rates`` is the sensitivity-based rate allocation. Device backends live in
``dropbp.backends``; the core never imports a device library. Here the layers meet: the core names no
training framework, and the DeepSpeed integration registers itself with it (:mod:`dropbp.frameworks`).
"""

from .allocation import allocate_rates
from .api import apply
from .controller import DropBPController
from .discovery import SUPPORTED_ARCHITECTURES, Branch
from .integrations import deepspeed as _deepspeed  # noqa: F401  (registers DeepSpeed with dropbp.frameworks)

__version__ = "0.1.0"

__all__ = ["SUPPORTED_ARCHITECTURES", "Branch", "DropBPController", "allocate_rates", "apply", "__version__"]
