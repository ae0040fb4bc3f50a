"""Device backends: ``dropbp.backends.get(name=None)`` picks one by name, ``DROPBP_BACKEND``, or detection.

Each backend is one short module; device libraries are imported only when a backend is asked whether
it is available or is used, never when this package is imported. Other packages add backends through
the entry-point group ``dropbp.backends`` (the entry point names a :class:`Backend` subclass), e.g. in
their ``pyproject.toml``::

    [project.entry-points."dropbp.backends"]
    npu = "my_package.dropbp_npu:NPUBackend"

Built-in names cannot be taken over by a plugin, and plugins are used only when named (argument or
``DROPBP_BACKEND``): auto-detection stays with the built-in devices, so installing a plugin never
changes what an unconfigured script runs on.
"""

from __future__ import annotations

import os
from importlib.metadata import EntryPoint, entry_points

from dropbp.backends.base import Backend, BackendUnavailable, UnknownBackend, describe
from dropbp.backends.cpu import CPUBackend
from dropbp.backends.cuda import CUDABackend
from dropbp.backends.hpu import HPUBackend
from dropbp.backends.lazy import LazyEngineBackend
from dropbp.backends.xpu import XPUBackend

__all__ = [
    "ENTRY_POINT_GROUP",
    "Backend",
    "BUILTIN",
    "BackendUnavailable",
    "UnknownBackend",
    "available",
    "detection",
    "get",
]

ENTRY_POINT_GROUP = "dropbp.backends"
ENV_VAR = "DROPBP_BACKEND"

#: The built-in backend classes by name (plugins come from the entry points of ENTRY_POINT_GROUP).
BUILTIN: dict[str, type[Backend]] = {
    "cpu": CPUBackend,
    "cuda": CUDABackend,
    "hpu": HPUBackend,
    "lazy": LazyEngineBackend,
    "xpu": XPUBackend,
}
#: Auto-detection order: accelerators first (Gaudi, then NVIDIA, then Intel GPU), the CPU last.
_DETECTION_ORDER = ("hpu", "cuda", "xpu", "cpu")


def _plugins() -> dict[str, EntryPoint]:
    found = {ep.name.strip().lower(): ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return {name: ep for name, ep in found.items() if name not in BUILTIN}


def available() -> list[str]:
    """Names of the registered backends (built-in and plugins), whether or not their device is here."""
    return sorted({*BUILTIN, *_plugins()})


def detection() -> list[tuple[str, str | None]]:
    """Each built-in device in auto-detection order with why it is unavailable (None: available).

    What :func:`get` would detect, and why the devices before it were passed over: reports such as
    ``dropbp check`` show it, since "why did it pick the CPU?" is the first question on a GPU host.
    """
    return [(n, BUILTIN[n].unavailable_reason()) for n in _DETECTION_ORDER]


def _load_plugin(name: str, ep: EntryPoint) -> type[Backend]:
    dist = f" from {ep.dist.name} {ep.dist.version}" if ep.dist is not None else ""
    where = f"dropbp backend {name!r} (entry point {ep.value!r}{dist})"
    try:
        cls = ep.load()
    except Exception as exc:  # any failure inside a third-party import becomes one clear line
        raise BackendUnavailable(
            f"{where} failed to import ({describe(exc)}); reinstall the package that provides it"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BackendUnavailable(
            f"{where} is not a dropbp.backends.Backend subclass; fix or remove that package"
        ) from None  # every registry error is one line, even when raised while another is handled
    return cls


def _lookup(name: str, source: str) -> type[Backend]:
    if name in BUILTIN:
        return BUILTIN[name]
    plugins = _plugins()
    if name in plugins:
        return _load_plugin(name, plugins[name])
    raise UnknownBackend(
        f"unknown dropbp backend {name!r}{source}; valid names: {', '.join([*available(), 'auto'])} "
        f"(other packages add backends through the entry-point group {ENTRY_POINT_GROUP!r})"
    ) from None


def get(name: str | None = None) -> Backend:
    """The backend called ``name``, else ``$DROPBP_BACKEND``, else the first available of hpu, cuda, xpu, cpu.

    Raises :class:`UnknownBackend` for a name nobody registered and :class:`BackendUnavailable` when
    the named device or its stack is missing; both messages are one line that says what to do.
    """
    if name is None:
        requested, source = os.environ.get(ENV_VAR, "auto"), f" (from {ENV_VAR})"
    elif isinstance(name, str):
        requested, source = name, ""
    else:
        raise TypeError(f"backend name must be a str or None, got {type(name).__name__}")
    requested = requested.strip().lower() or "auto"
    if requested == "auto":  # the CPU is always available, so detection always ends with a backend
        return next(BUILTIN[n]() for n in _DETECTION_ORDER if BUILTIN[n].is_available())
    cls = _lookup(requested, source)
    reason = cls.unavailable_reason()
    if reason is not None:
        raise BackendUnavailable(f"dropbp backend {requested!r}{source} is unavailable: {reason}") from None
    return cls()
