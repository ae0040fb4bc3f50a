"""Device backends: ``dropbp.backends.get(name=None)`` picks one by name, ``DROPBP_BACKEND``, or
detection. Each backend is one short module; device libraries are imported only when used."""

from __future__ import annotations

import os

from .base import Backend, BackendUnavailable
from .cpu import CPUBackend

__all__ = ["Backend", "BackendUnavailable", "available", "get"]

_REGISTRY: dict[str, type[Backend]] = {"cpu": CPUBackend}
_DETECTION_ORDER = ("cpu",)


def available() -> list[str]:
    """Names of the registered backends."""
    return sorted(_REGISTRY)


def get(name: str | None = None) -> Backend:
    """The backend called ``name``, else ``$DROPBP_BACKEND``, else the first available one."""
    requested = name if name is not None else os.environ.get("DROPBP_BACKEND", "auto")
    requested = requested.strip().lower() or "auto"
    if requested == "auto":
        for candidate in _DETECTION_ORDER:
            if _REGISTRY[candidate].is_available():
                return _REGISTRY[candidate]()
    if requested not in _REGISTRY:
        raise ValueError(f"unknown dropbp backend {requested!r}; valid names: {', '.join(available())}, auto")
    cls = _REGISTRY[requested]
    if not cls.is_available():
        raise BackendUnavailable(f"dropbp backend {requested!r} is not available in this process")
    return cls()
