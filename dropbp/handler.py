"""The research code's import path of its ``DropBPHandler``; the handler lives in :mod:`dropbp.research`."""

from dropbp.research import DropBPHandler, setup_seed

__all__ = ["DropBPHandler", "setup_seed"]
