"""The research code's import path of its ``DropBP`` layer; the layer lives in :mod:`dropbp.research`."""

from dropbp.research import DropBP

__all__ = ["DropBP"]
