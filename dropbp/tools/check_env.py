"""The environment part of ``dropbp check``: which backend, why, on what device, with which software.

A report from hardware this project never ran on is only useful when it says exactly what ran, so
every fact comes from the place that knows it: the backend registry (why this backend), the backend
(device name, count, stack versions), package metadata (versions, without importing anything).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

import torch

from dropbp import __version__
from dropbp.backends import ENV_VAR, Backend, detection
from dropbp.tools.device_tools import tools_for

__all__ = ["backend_source", "environment"]

_PACKAGES = ("torch", "transformers", "peft", "accelerate")


def backend_source(requested: str | Backend | None) -> str:
    """Why this backend: named by the caller, named by ``$DROPBP_BACKEND``, or auto-detected."""
    if isinstance(requested, Backend):
        return "given as a Backend instance"
    if requested is not None and requested.strip().lower() not in ("", "auto"):
        return f"named: --backend {requested}"
    env = os.environ.get(ENV_VAR, "").strip()
    if requested is None and env and env.lower() != "auto":
        return f"named by ${ENV_VAR}={env}"
    return "auto-detected (the first available of " + ", ".join(n for n, _ in detection()) + ")"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _collectives(backend: Backend) -> dict[str, object]:
    """The collective library the backend uses for ``torch.distributed``, and whether it is registered now
    (Gaudi's ``hccl`` registers when its module is imported, which ``init_distributed`` does)."""
    dist = torch.distributed
    registered = None
    if dist.is_available() and hasattr(dist, "is_backend_available"):
        try:
            registered = bool(dist.is_backend_available(backend.distributed_backend))
        except Exception:  # an unknown name raises in some versions: "not registered" is the answer
            registered = False
    return {"name": backend.distributed_backend, "torch_distributed": dist.is_available(), "registered": registered}


def environment(backend: Backend, requested: str | Backend | None) -> dict[str, object]:
    """Everything about this process that decides what ``dropbp check`` measured (JSON-ready)."""
    return {
        "backend": backend.name,
        "backend_source": backend_source(requested),
        "detection": {name: reason for name, reason in detection()},
        "device": str(backend.device),
        **tools_for(backend).environment(),
        "collectives": _collectives(backend),
        "pattern_bound": backend.default_max_patterns,
        "graph_compilations_reported": tools_for(backend).graph_compilations() is not None,
        "allocator_stats": backend.has_allocator_stats,
        "versions": {"dropbp": __version__, "python": sys.version.split()[0], **{p: _version(p) for p in _PACKAGES}},
        "platform": platform.platform(),
    }
