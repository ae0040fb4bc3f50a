"""Timing a block of device work: host clock after a sync, or device-side events where they exist."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["EventTimer", "HostTimer"]


class HostTimer:
    """Wall-clock timing of a block: waits for the device on entry and exit, then reads the host clock."""

    def __init__(self, synchronize: Callable[[], None]) -> None:
        self._synchronize = synchronize
        self._start = self._end = 0.0

    def __enter__(self) -> HostTimer:
        self._synchronize()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._synchronize()
        self._end = time.perf_counter()

    @property
    def seconds(self) -> float:
        return self._end - self._start


class EventTimer:
    """Device-side timing with the device's events (``torch.cuda.Event``, ``torch.xpu.Event``).

    Events are recorded in the device's stream, so the block is not serialised with the host; only
    reading :attr:`seconds` waits for the end event.
    """

    def __init__(self, device_module: Any) -> None:
        self._start = device_module.Event(enable_timing=True)
        self._end = device_module.Event(enable_timing=True)

    def __enter__(self) -> EventTimer:
        self._start.record()
        return self

    def __exit__(self, *exc: object) -> None:
        self._end.record()

    @property
    def seconds(self) -> float:
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1000.0
