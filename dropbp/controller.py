"""``dropbp.apply`` and the controller it returns: the public face of the core.

The controller decides the drop pattern once per training-mode forward of the model it was applied
to (a forward pre-hook on that model, before any branch runs) and keeps it until the next one, so
activation-checkpointing recomputation during backward sees the same decision. Each branch module
consults that decision when it is called.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .adapters import Branch, find_branches
from .execution import attach_no_grad_hooks
from .sampler import PatternSampler, check_rates, max_total_rate

__all__ = ["DropBPController", "apply"]

# Modules (models and branch modules) that already carry a controller: applying twice would stack
# hooks and make two samplers fight over one model.
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, DropBPController] = weakref.WeakKeyDictionary()

_STATE_VERSION = 1


def _check_drop_rate(drop_rate: object) -> float:
    if isinstance(drop_rate, bool) or not isinstance(drop_rate, (int, float)):
        raise TypeError(f"drop_rate must be a number in [0, 1), got {type(drop_rate).__name__}")
    value = float(drop_rate)
    if not (0.0 <= value < 1.0):  # also rejects NaN
        raise ValueError(f"drop_rate must be in [0, 1), got {drop_rate!r}")
    return value


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


class DropBPController:
    """Drop policy attached to one model. Create it with :func:`dropbp.apply`."""

    def __init__(
        self,
        model: nn.Module,
        branches: list[Branch],
        drop_rate: float,
        seed: int,
        max_patterns: int | None,
    ) -> None:
        self._model = model
        self._branches = branches
        self.drop_rate = drop_rate
        self.seed = seed
        self.max_patterns = max_patterns
        self._step = 0
        self._dropped: frozenset[int] = frozenset()
        self._last_dropped: tuple[str, ...] = ()
        self._sampler = PatternSampler([drop_rate] * len(branches), seed, max_patterns)
        for b in branches:
            b.rate = drop_rate
        self._handles = [model.register_forward_pre_hook(self._on_model_forward)]
        for index, branch in enumerate(branches):
            self._handles += attach_no_grad_hooks(branch.module, self._dropped_test(index))
        for module in (model, *(b.module for b in branches)):
            _ATTACHED[module] = self
        self._removed = False

    # -- the per-step decision -------------------------------------------------------------------
    def _dropped_test(self, index: int):
        return lambda: index in self._dropped

    def _on_model_forward(self, model: nn.Module, args: tuple) -> None:
        if not (model.training and torch.is_grad_enabled()):
            return  # eval or no-grad forwards drop nothing and leave the step's decision alone
        self._dropped = self._sampler.pattern(self._step)
        self._step += 1
        self._last_dropped = tuple(self._branches[i].name for i in sorted(self._dropped))

    # -- public contract -------------------------------------------------------------------------
    @property
    def branches(self) -> list[Branch]:
        """The branches in forward order (``.name``, ``.kind``, ``.flops``, ``.rate``)."""
        return list(self._branches)

    @property
    def rates(self) -> list[float]:
        return [b.rate for b in self._branches]

    def set_rates(self, rates: Sequence[float]) -> None:
        """Set one drop rate per branch (branch order); each in [0, 1), summing to at most N - 1."""
        self._check_attached()
        values = check_rates(rates, len(self._branches))
        for b, r in zip(self._branches, values, strict=True):
            b.rate = r
        self._sampler = PatternSampler(values, self.seed, self.max_patterns)

    @property
    def last_dropped(self) -> tuple[str, ...]:
        """Names of the branches dropped in the most recent training-mode forward."""
        return self._last_dropped

    @property
    def step(self) -> int:
        """How many training-mode forwards have drawn a pattern so far."""
        return self._step

    def dropped_at(self, step: int) -> tuple[str, ...]:
        """Names of the branches that drop at ``step`` (a pure function of seed, step and rates)."""
        _check_int("step", step, 0)
        return tuple(self._branches[i].name for i in sorted(self._sampler.pattern(step)))

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue with the same patterns: rates, seed, step counter."""
        return {
            "version": _STATE_VERSION,
            "branches": [b.name for b in self._branches],
            "rates": self.rates,
            "drop_rate": self.drop_rate,
            "seed": self.seed,
            "step": self._step,
            "max_patterns": self.max_patterns,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; the branches must be the same as when it was saved."""
        self._check_attached()
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
        missing = {"version", "branches", "rates", "drop_rate", "seed", "step", "max_patterns"} - set(state)
        if missing:
            raise ValueError(f"state is missing keys {sorted(missing)}; pass the dict from state_dict()")
        if state["version"] != _STATE_VERSION:
            raise ValueError(f"state version {state['version']} is not supported (expected {_STATE_VERSION})")
        names = [b.name for b in self._branches]
        if list(state["branches"]) != names:
            raise ValueError(
                "state was saved for different branches: "
                f"saved {len(state['branches'])} starting {list(state['branches'])[:2]}, "
                f"this model has {len(names)} starting {names[:2]}"
            )
        self.drop_rate = _check_drop_rate(state["drop_rate"])
        self.seed = _check_int("seed", state["seed"], 0)
        mp = state["max_patterns"]
        self.max_patterns = None if mp is None else _check_int("max_patterns", mp, 1)
        self.set_rates(state["rates"])
        self._step = _check_int("step", state["step"], 0)

    def remove(self) -> None:
        """Detach from the model: every hook is removed and the model is exactly as before."""
        if self._removed:
            return
        for h in self._handles:
            h.remove()
        self._handles = []
        for module in (self._model, *(b.module for b in self._branches)):
            if _ATTACHED.get(module) is self:
                del _ATTACHED[module]
        self._dropped = frozenset()
        self._removed = True

    def _check_attached(self) -> None:
        if self._removed:
            raise RuntimeError("this DropBP controller was removed; call dropbp.apply(model, ...) again")

    def __repr__(self) -> str:
        kinds = {k: sum(b.kind == k for b in self._branches) for k in ("attn", "mlp")}
        return (
            f"DropBPController({len(self._branches)} branches ({kinds['attn']} attn, {kinds['mlp']} mlp), "
            f"drop_rate={self.drop_rate}, seed={self.seed}, max_patterns={self.max_patterns}, "
            f"step={self._step})"
        )


def apply(
    model: nn.Module,
    drop_rate: float,
    *,
    seed: int = 0,
    branches: Sequence[str] | None = None,
    max_patterns: int | None = None,
    seq_len: int = 512,
) -> DropBPController:
    """Attach DropBP to ``model``: each training step drops the backward of random residual branches.

    ``drop_rate`` is every branch's initial drop probability (``calibrate`` or ``set_rates`` can
    make them differ). ``seed`` fixes the patterns: they are a function of (seed, step), identical on
    every process. ``branches`` names the branch modules of a model that is not a recognised Hugging
    Face architecture. ``max_patterns`` bounds how many distinct patterns ever occur (for compiled
    graphs). ``seq_len`` is the typical sequence length, used only to weigh attention FLOPs.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    p = _check_drop_rate(drop_rate)
    seed = _check_int("seed", seed, 0)
    if max_patterns is not None:
        max_patterns = _check_int("max_patterns", max_patterns, 1)
    seq_len = _check_int("seq_len", seq_len, 1)
    if branches is not None and not isinstance(branches, (list, tuple)):
        raise TypeError(f"branches must be a list of module names, got {type(branches).__name__}")
    found = find_branches(model, None if branches is None else list(branches), seq_len)
    taken = [m for m in (model, *(b.module for b in found)) if m in _ATTACHED]
    if taken:
        raise RuntimeError(
            "DropBP is already attached to this model (or to some of its branches); "
            "call .remove() on the existing controller first"
        )
    n = len(found)
    if p * n > max_total_rate(n) + 1e-9:
        largest = math.floor(max_total_rate(n) / n * 1000) / 1000
        raise ValueError(
            f"drop_rate={drop_rate} with {n} branches would drop every branch in some steps, leaving "
            f"nothing to train; with {n} branches drop_rate must be at most {largest}"
        )
    return DropBPController(model, found, p, seed, max_patterns)
